# The CUDA compute backend (src/kernels/cuda/, issue 21) and the NCCL comm backend (src/comm/comm_nccl.c).
#
# TERA_CUDA = AUTO (default): built when nvcc and cuBLAS are found, skipped with a message otherwise;
# ON: required (configuration fails without them); OFF: never built. The backend is a separate static
# library, tera_cuda, linked into tera_lib; TERA_CUDA is then a public compile definition, so code
# that selects a backend (src/kernels/cuda/backend_cuda.h) and tests/test_cuda.c see it.
# NCCL (nccl.h + libnccl) adds TERA_NCCL to tera_lib: comm_nccl.c compiles to nothing without it. Warnings are errors for host and device code (nvcc -Werror all-warnings).
# Included by CMakeLists.txt after tera_lib exists.
set(TERA_CUDA AUTO CACHE STRING "CUDA compute backend: AUTO (when nvcc and cuBLAS are found), ON, OFF")
set_property(CACHE TERA_CUDA PROPERTY STRINGS AUTO ON OFF)
# One architecture keeps the compile short (H100/H200: 90); -DTERA_CUDA_ARCH="80;90" for more.
set(TERA_CUDA_ARCH 90 CACHE STRING "CUDA architectures the backend is compiled for")

set(TERA_HAVE_CUDA OFF)
if(TERA_CUDA STREQUAL "OFF")
  message(STATUS "tera: CUDA backend off (TERA_CUDA=OFF)")
else()
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(TERA_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH PATHS /usr/local/cuda/bin NO_CACHE)
    if(TERA_NVCC)
      set(CMAKE_CUDA_COMPILER ${TERA_NVCC})
    endif()
  endif()
  check_language(CUDA)
  set(_tera_cuda_why "")
  if(NOT CMAKE_CUDA_COMPILER)
    set(_tera_cuda_why "nvcc not found (set CUDACXX or put it in PATH)")
  else()
    get_filename_component(_tera_nvcc_bin ${CMAKE_CUDA_COMPILER} DIRECTORY)
    if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT})
      get_filename_component(CUDAToolkit_ROOT ${_tera_nvcc_bin}/.. ABSOLUTE)
    endif()
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND OR NOT TARGET CUDA::cublas OR NOT TARGET CUDA::cublasLt)
      set(_tera_cuda_why "the CUDA toolkit's cuBLAS/cuBLASLt libraries were not found")
    endif()
  endif()
  if(_tera_cuda_why STREQUAL "")
    set(TERA_HAVE_CUDA ON)
  elseif(TERA_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TERA_CUDA=ON but ${_tera_cuda_why}")
  else()
    message(STATUS "tera: CUDA backend skipped: ${_tera_cuda_why} (TERA_CUDA=AUTO)")
  endif()
endif()

if(TERA_HAVE_CUDA)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES ${TERA_CUDA_ARCH})
  endif()
  enable_language(CUDA)
  # tera_lib exists before CUDA is enabled: CMake wants the property on every target (CMP0104)
  set_property(TARGET tera_lib PROPERTY CUDA_ARCHITECTURES ${CMAKE_CUDA_ARCHITECTURES})
  # executables stay linked by the C compiler (its flags: -fopenmp, -fsanitize); nothing here needs
  # a device link step (no relocatable device code)
  set(CMAKE_CUDA_LINKER_PREFERENCE 0)
  set(CMAKE_CUDA_LINKER_PREFERENCE_PROPAGATES 0)
  file(GLOB TERA_CUDA_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/kernels/cuda/*.cu)
  add_library(tera_cuda STATIC ${TERA_CUDA_SRC})
  # the directory's options are the C compiler's (-Wall ... -march=native): nvcc gets its own
  set_property(TARGET tera_cuda PROPERTY COMPILE_OPTIONS "")
  target_compile_options(tera_cuda PRIVATE --Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror,-Wno-unused-parameter
    -D_GNU_SOURCE $<$<CONFIG:Release>:-O3>)
  set_target_properties(tera_cuda PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON POSITION_INDEPENDENT_CODE ON)
  target_include_directories(tera_cuda PRIVATE ${CMAKE_SOURCE_DIR}/include ${CMAKE_SOURCE_DIR}/src)
  # the runtime statically (it loads the driver on first use) and cuBLAS by dlopen when a cuda
  # backend is created: a tera that never selects cuda maps no CUDA library at start
  target_link_libraries(tera_cuda PUBLIC CUDA::cudart_static ${CMAKE_DL_LIBS})
  target_compile_definitions(tera_cuda PRIVATE TERA_CUDA_LIBDIR="${CUDAToolkit_LIBRARY_DIR}")
  # the backend calls a few tera_lib functions (threads, the RNG fill, RoPE tables, errors) and
  # tera_lib creates the backend: a cycle of static libraries, which CMake links by repeating them
  target_link_libraries(tera_cuda PRIVATE tera_lib)
  target_link_libraries(tera_lib PUBLIC tera_cuda)
  target_compile_definitions(tera_lib PUBLIC TERA_CUDA=1)
  message(STATUS "tera: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")

  find_path(TERA_NCCL_INC nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}/include)
  find_library(TERA_NCCL_LIB nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
  if(TERA_NCCL_INC AND TERA_NCCL_LIB)
    # comm_nccl.c loads libnccl with dlopen when the NCCL backend starts (as cuBLAS above)
    get_filename_component(_tera_nccl_dir ${TERA_NCCL_LIB} DIRECTORY)
    target_include_directories(tera_lib PRIVATE ${TERA_NCCL_INC})
    target_compile_definitions(tera_lib PRIVATE TERA_NCCL=1 TERA_NCCL_LIBDIR="${_tera_nccl_dir}")
    message(STATUS "tera: NCCL comm backend on (${TERA_NCCL_LIB})")
  else()
    message(STATUS "tera: NCCL comm backend skipped: nccl.h or libnccl not found")
  endif()
endif()
