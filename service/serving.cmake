# (area being written)
