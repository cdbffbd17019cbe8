# Tensor parallel: the candidate exchange (NCCL device API / CUDA peer) and the
# all-gather baseline (library fs_tp), and their benchmark fs_tp_bench.
# Included from kernels/CMakeLists.txt after fs_kernels is defined (CUDA
# builds only).

add_library(fs_tp STATIC
  ${CMAKE_CURRENT_LIST_DIR}/tp_exchange.cu
  ${CMAKE_CURRENT_LIST_DIR}/allgather_baseline.cu)
target_include_directories(fs_tp PUBLIC ${PROJECT_SOURCE_DIR}
                                        ${CUDAToolkit_INCLUDE_DIRS})
target_link_libraries(fs_tp PUBLIC fs_kernels CUDA::cudart CUDA::cublas
                                   ${FS_NCCL_LIBRARY} Threads::Threads)
set_target_properties(fs_tp PROPERTIES POSITION_INDEPENDENT_CODE ON)
fs_target_warnings(fs_tp)

add_executable(fs_tp_bench ${CMAKE_CURRENT_LIST_DIR}/bench/tp_bench.cu)
target_link_libraries(fs_tp_bench PRIVATE fs_tp)
fs_target_warnings(fs_tp_bench)
