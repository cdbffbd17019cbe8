"""How many noise blocks survive pruning under today's block bound, and
under a per-run bound (a construction, not in the project, that would also
draw each run of 4 tokens' smallest exponential). Flat logits like
fs_bench's (std 2.5, temperature 1), V = 151936, blocks of 16, runs of 4,
64 rows. Floors are either the final winner ("_or": oracle) or streamed
("_st"): the vocabulary in 18 pieces in order, each piece checked against
the best score of the pieces before it; the first piece is not counted
(the kernel scores a launch's first calls exactly). cur_* / run_* count
surviving blocks per row; runs_cur_* / runs_run_* count the token-word
Philox calls that survivors then need (4 per surviving block today, 1 per
surviving run with the per-run bound). Bounds without the kernel's
rounding margins. Run: python3 bound_sim.py (numpy).
"""
import numpy as np

rng = np.random.default_rng(1)
V, B, PIECES = 151936, 64, 18
nb = V // 16
res = {"cur_or": 0, "run_or": 0, "cur_st": 0, "run_st": 0, "runs_cur_or": 0, "runs_run_or": 0, "runs_cur_st": 0, "runs_run_st": 0}
for row in range(B):
    x = rng.normal(0, 2.5, size=(nb, 16))
    emin = rng.exponential(1 / 16, size=nb)            # Exp(16)
    first = rng.integers(0, 16, size=nb)
    e = emin[:, None] + rng.exponential(1.0, size=(nb, 16))
    e[np.arange(nb), first] = emin
    s = x - np.log(e)
    best = s.max()
    # today's bound: block max logit + the block's largest noise
    cur = x.max(1) - np.log(emin)
    # proposal: per run of 4, run max logit + run's largest noise
    xr = x.reshape(nb, 4, 4)
    er = e.reshape(nb, 4, 4)
    run_noise_max = -np.log(er.min(2))                 # exact run minimum
    runb = xr.max(2) + run_noise_max                    # (nb, 4)
    # streaming floors: pieces of blocks in order
    edges = np.linspace(0, nb, PIECES + 1).astype(int)
    floor = -np.inf
    cur_st = run_st = runs_cur = runs_run = 0
    for p in range(PIECES):
        sl = slice(edges[p], edges[p + 1])
        if p == 0:  # the kernel scores a launch's first calls exactly
            floor = max(floor, s[sl].max())
            continue
        cur_st += (cur[sl] >= floor).sum()
        runs_cur += (cur[sl] >= floor).sum() * 4   # a surviving block: 4 word calls
        rs = (runb[sl] >= floor)
        run_st += rs.any(1).sum()
        runs_run += rs.sum()                      # a surviving run: 1 word call
        floor = max(floor, s[sl].max())
    res["cur_st"] += cur_st; res["run_st"] += run_st
    res["runs_cur_st"] += runs_cur; res["runs_run_st"] += runs_run
    res["cur_or"] += (cur >= best).sum(); res["run_or"] += (runb >= best).any(1).sum()
    res["runs_cur_or"] += (cur >= best).sum() * 4; res["runs_run_or"] += (runb >= best).sum()
for k, v in res.items():
    print(f"{k:12s} {v / B:10.1f} per row")
