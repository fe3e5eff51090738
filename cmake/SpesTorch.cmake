# Finding libtorch for spes, used by the build (CMakeLists.txt) and by the installed package
# (spesConfig.cmake), so that both see the same torch with the same header order.
#
# - spes_find_torch(): finds the libtorch of the PyTorch wheel in the project's .venv/ (what
#   scripts/setup.sh installs) unless Torch_DIR or CMAKE_PREFIX_PATH already name one; points
#   FindOpenMP at the libgomp that libtorch itself loads, so the process has one OpenMP runtime.
# - spes_system_header_links(DIR): the wheel's include directory carries its own copies of
#   fmt (12.x) and protobuf (an older 3.x). spes is built against Debian's fmt/spdlog/protobuf/
#   gRPC, so their headers must win: this fills DIR with links to the system's fmt/, spdlog/ and
#   google/ header trees, for the caller to put BEFORE torch's include directories.
#   torch/torch.h itself uses neither fmt nor protobuf.

function(spes_find_torch)
  if(NOT Torch_DIR AND NOT TARGET torch)
    set(venv_python "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    if(DEFINED ENV{SPES_PYTHON})
      set(venv_python "$ENV{SPES_PYTHON}")
    endif()
    if(EXISTS "${venv_python}")
      execute_process(
        COMMAND "${venv_python}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
        OUTPUT_VARIABLE torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
        RESULT_VARIABLE rc ERROR_QUIET)
      if(rc EQUAL 0 AND EXISTS "${torch_prefix}/Torch/TorchConfig.cmake")
        set(Torch_DIR "${torch_prefix}/Torch" CACHE PATH "libtorch's CMake package" FORCE)
      endif()
    endif()
  endif()
  # The CUDA wheel's package autodetects GPU architectures for nvcc; spes compiles no CUDA
  # sources of its own through it, so name one list instead of probing (quieter, deterministic).
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0")
  endif()
  # (torch's cuda.cmake warns when CMAKE_CUDA_ARCHITECTURES is set, as enable_language caches it)
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
  find_package(Torch REQUIRED)
  if(NOT Torch_DIR)
    message(FATAL_ERROR "libtorch not found: run scripts/setup.sh (installs PyTorch 2.11.0 into "
                        ".venv/) or pass -DTorch_DIR=<libtorch>/share/cmake/Torch")
  endif()
  get_filename_component(torch_root "${Torch_DIR}/../../.." ABSOLUTE)
  set(SPES_TORCH_LIB_DIR "${torch_root}/lib" CACHE INTERNAL "libtorch's library directory")
  if(EXISTS "${torch_root}/lib/libgomp.so.1" AND NOT OpenMP_CXX_LIB_NAMES)
    set(OpenMP_CXX_FLAGS "-fopenmp" CACHE STRING "OpenMP flags" FORCE)
    set(OpenMP_CXX_LIB_NAMES "gomp" CACHE STRING "OpenMP runtime" FORCE)
    set(OpenMP_gomp_LIBRARY "${torch_root}/lib/libgomp.so.1" CACHE FILEPATH
        "libtorch's own libgomp (one OpenMP runtime per process)" FORCE)
  endif()
  set(TORCH_LIBRARIES "${TORCH_LIBRARIES}" PARENT_SCOPE)
  set(TORCH_CXX_FLAGS "${TORCH_CXX_FLAGS}" PARENT_SCOPE)
  set(Torch_VERSION "${Torch_VERSION}" PARENT_SCOPE)
  set(CUDA_FOUND "${CUDA_FOUND}" PARENT_SCOPE)
  set(CUDA_VERSION "${CUDA_VERSION}" PARENT_SCOPE)
endfunction()

function(spes_system_header_links links_dir)
  file(MAKE_DIRECTORY "${links_dir}")
  foreach(tree fmt spdlog google)
    if(tree STREQUAL "google")
      set(probe "google/protobuf/message.h")
    else()
      set(probe "${tree}/core.h")
      if(tree STREQUAL "spdlog")
        set(probe "spdlog/spdlog.h")
      endif()
    endif()
    find_path(SPES_SYSTEM_${tree}_INCLUDE "${probe}" PATHS /usr/include /usr/local/include
              NO_DEFAULT_PATH)
    if(SPES_SYSTEM_${tree}_INCLUDE AND NOT EXISTS "${links_dir}/${tree}")
      file(CREATE_LINK "${SPES_SYSTEM_${tree}_INCLUDE}/${tree}" "${links_dir}/${tree}" SYMBOLIC)
    endif()
  endforeach()
endfunction()
