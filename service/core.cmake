add_library(fs_service_core
  dtype_convert.cc
  sampling_params.cc)
target_include_directories(fs_service_core PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(fs_service_core PUBLIC absl::status absl::statusor absl::strings absl::str_format)
fs_target_warnings(fs_service_core)
