# The Python extension loom._C (nanobind over DLPack; no torch at build time).
#
# Included by the top-level CMakeLists.txt when LOOM_BUILD_PYTHON=ON (what `pip install .` does
# through scikit-build-core), and by python/CMakeLists.txt, the extension-only project that needs
# no CUDA compiler. Two ways to get libloom:
#   LOOM_PREBUILT_LIBRARY unset   link the `loom` target of this build and install libloom.so
#                                 next to the extension
#   LOOM_PREBUILT_LIBRARY=/p/libloom.so   link that file and install a copy of it; the `loom`
#                                 target (if this is the top-level project) is left out of `all`
# The extension finds libloom.so through RPATH $ORIGIN, so the package directory is
# self-contained.

set(LOOM_PREBUILT_LIBRARY "" CACHE FILEPATH "a libloom.so built elsewhere: build only the Python extension against it")
set(LOOM_PYTHON_SOURCE_DIR ${CMAKE_CURRENT_LIST_DIR}/..)
get_filename_component(LOOM_PYTHON_SOURCE_DIR ${LOOM_PYTHON_SOURCE_DIR} ABSOLUTE)

find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
if(NOT nanobind_DIR)
  execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
                  OUTPUT_VARIABLE nanobind_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
find_package(nanobind CONFIG)
if(NOT nanobind_FOUND)
  message(FATAL_ERROR "loom Python extension: nanobind not found for ${Python_EXECUTABLE} "
                      "(pip install nanobind, or pass -Dnanobind_DIR=...)")
endif()

# Headers of the CUDA runtime API: the public loom headers include <cuda_runtime_api.h> for
# cudaStream_t. Prefer a real toolkit; a GPU machine that only has the Python CUDA wheels (no
# crt/ headers) gets a one-typedef stand-in, which is ABI-identical (an opaque pointer).
function(loom_python_cuda_include out_var)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND EXISTS "${CUDAToolkit_INCLUDE_DIRS}/cuda_runtime_api.h")
    set(${out_var} ${CUDAToolkit_INCLUDE_DIRS} PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND "${Python_EXECUTABLE}" -c
                  "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))"
                  OUTPUT_VARIABLE wheel_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(wheel_include AND EXISTS "${wheel_include}/cuda_runtime_api.h" AND EXISTS "${wheel_include}/crt/host_defines.h")
    set(${out_var} ${wheel_include} PARENT_SCOPE)
    return()
  endif()
  message(STATUS "loom Python extension: no CUDA toolkit headers; using python/src/cuda_shim (cudaStream_t only)")
  set(${out_var} ${LOOM_PYTHON_SOURCE_DIR}/python/src/cuda_shim PARENT_SCOPE)
endfunction()

if(LOOM_PREBUILT_LIBRARY)
  if(NOT EXISTS "${LOOM_PREBUILT_LIBRARY}")
    message(FATAL_ERROR "LOOM_PREBUILT_LIBRARY=${LOOM_PREBUILT_LIBRARY} does not exist")
  endif()
  loom_python_cuda_include(loom_cuda_include)
  add_library(loom_prebuilt SHARED IMPORTED)
  set_target_properties(loom_prebuilt PROPERTIES
    IMPORTED_LOCATION "${LOOM_PREBUILT_LIBRARY}"
    IMPORTED_NO_SONAME ON
    INTERFACE_INCLUDE_DIRECTORIES "${LOOM_PYTHON_SOURCE_DIR}/include;${loom_cuda_include}")
  set(loom_python_link loom_prebuilt)
  if(TARGET loom)
    # Top-level build with a prebuilt library: compile only what the package needs.
    set_target_properties(loom PROPERTIES EXCLUDE_FROM_ALL ON)
    if(TARGET loom_core)
      set_target_properties(loom_core PROPERTIES EXCLUDE_FROM_ALL ON)
    endif()
  endif()
else()
  if(NOT TARGET loom)
    message(FATAL_ERROR "loom Python extension: no `loom` target here; configure the top-level project "
                        "(-DLOOM_BUILD_PYTHON=ON) or pass -DLOOM_PREBUILT_LIBRARY=/path/libloom.so")
  endif()
  set(loom_python_link loom)
endif()

# NB_STATIC: nanobind's runtime is compiled in, so the extension has no other shared dependency
# than libloom.so.
nanobind_add_module(loom_python_ext NB_STATIC
  ${LOOM_PYTHON_SOURCE_DIR}/python/src/ext.cc
  ${LOOM_PYTHON_SOURCE_DIR}/python/src/binding_common.cc
  ${LOOM_PYTHON_SOURCE_DIR}/python/src/moe.cc
  ${LOOM_PYTHON_SOURCE_DIR}/python/src/tensor_arg.cc)
set_target_properties(loom_python_ext PROPERTIES
  OUTPUT_NAME _C
  BUILD_RPATH "$ORIGIN"
  INSTALL_RPATH "$ORIGIN"
  CXX_STANDARD 20
  CXX_STANDARD_REQUIRED ON)
target_compile_options(loom_python_ext PRIVATE -Wall -Wextra -Wno-unused-parameter)
target_link_libraries(loom_python_ext PRIVATE ${loom_python_link})

# scikit-build-core installs into the wheel's platlib; the package directory is `loom`.
install(TARGETS loom_python_ext LIBRARY DESTINATION loom)
if(NOT SKBUILD)
  # A plain `cmake --install --prefix DIR` gives a complete package: DIR/loom is importable with
  # PYTHONPATH=DIR (pip's wheel gets the sources from pyproject.toml's wheel.packages instead).
  install(DIRECTORY ${LOOM_PYTHON_SOURCE_DIR}/python/loom/ DESTINATION loom FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed")
endif()
if(LOOM_PREBUILT_LIBRARY)
  install(FILES "${LOOM_PREBUILT_LIBRARY}" DESTINATION loom RENAME libloom.so)
else()
  install(TARGETS loom LIBRARY DESTINATION loom)
endif()
