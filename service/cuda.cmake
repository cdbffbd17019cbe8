# fs_cuda_backend (CUDA builds only): the CUDA engine (sharded weights,
# tensor parallel through fs_tp's candidate exchange, two slots in flight) and
# the CUDA/NCCL -> absl::Status mapping it reports errors through.
add_library(fs_cuda_backend STATIC
  cuda_engine.cc
  cuda_status.cc)
target_include_directories(fs_cuda_backend PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(fs_cuda_backend
  PUBLIC fs_kernels fs_tp fs_service_core fs_weights fs_status CUDA::cudart
         ${FS_NCCL_LIBRARY} absl::status absl::statusor absl::strings)
fs_target_warnings(fs_cuda_backend)
