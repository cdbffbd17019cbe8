# fs_serving: request codec, batcher, metrics, the gRPC Sampler service and
# the Server lifecycle. flashsamplerd: the daemon (flags -> ServerOptions).
add_library(fs_serving STATIC
  batcher.cc
  metrics.cc
  request_codec.cc
  sampler_service.cc
  server.cc)
target_include_directories(fs_serving PUBLIC ${PROJECT_SOURCE_DIR})
target_compile_definitions(fs_serving PRIVATE FS_VERSION="${PROJECT_VERSION}")
target_link_libraries(fs_serving
  PUBLIC fs_service_core fs_weights fs_cpu_backend fs_status fs_proto
         gRPC::grpc++ gRPC::grpc++_reflection
         prometheus-cpp::core
         absl::random_random absl::synchronization absl::time absl::strings
         absl::str_format Threads::Threads)
if(TARGET fs_cuda_backend)
  target_link_libraries(fs_serving PUBLIC fs_cuda_backend)
  target_compile_definitions(fs_serving PRIVATE FS_HAVE_CUDA_BACKEND=1)
endif()
fs_target_warnings(fs_serving)

add_executable(flashsamplerd main.cc)
target_link_libraries(flashsamplerd PRIVATE fs_serving absl::flags
                      absl::flags_parse absl::flags_usage)
fs_target_warnings(flashsamplerd)
