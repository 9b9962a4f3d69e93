# The installed C++ package: `cmake --install build --prefix DIR` gives
#   DIR/include/loom/*.h                          the public headers
#   DIR/lib/libloom.so                            the library (CUDA runtime linked in statically)
#   DIR/lib/cmake/loom/loom{Config,ConfigVersion,Targets*}.cmake
#   DIR/bin/loom-run, DIR/bin/loom-bench          when LOOM_BUILD_TOOLS is on
# so that a project built with CMAKE_PREFIX_PATH=DIR can do
#   find_package(loom CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE loom::loom)
# (examples/consumer is such a project; scripts/ci_consumer.sh builds it against an install).

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(LOOM_PREBUILT_LIBRARY)
  # cmake/python.cmake then leaves the `loom` target unbuilt, so there is no libloom to install.
  message(FATAL_ERROR "LOOM_INSTALL=ON installs the libloom built here, but LOOM_PREBUILT_LIBRARY is set; "
                      "pass -DLOOM_INSTALL=OFF")
endif()

set(LOOM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/loom)

# loom::loom for consumers; inside this build the target stays `loom`.
set_target_properties(loom PROPERTIES EXPORT_NAME loom)
# libloom's own dependencies (libcrypto, libstdc++) are system libraries: the installed copy needs no
# RPATH, and CMake's default already drops the build-tree one at install time.
install(TARGETS loom EXPORT loomTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/loom
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")

if(LOOM_BUILD_TOOLS)
  # Installed tools find libloom in ../lib, and cuBLAS / NCCL where they were linked from.
  set_target_properties(loom-bench PROPERTIES
    INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}"
    INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS loom-run loom-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

install(EXPORT loomTargets
  NAMESPACE loom::
  DESTINATION ${LOOM_INSTALL_CMAKEDIR})

# Consumers need the toolkit for CUDA::cudart_static (loom's link interface) and the runtime headers
# the public headers include; the same minimum as this build's find_package(CUDAToolkit).
set(LOOM_CUDATOOLKIT_MIN_VERSION 12.4)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/loomConfig.cmake.in
  ${PROJECT_BINARY_DIR}/loomConfig.cmake
  INSTALL_DESTINATION ${LOOM_INSTALL_CMAKEDIR})
# SameMajorVersion: find_package(loom 0.2) accepts an installed 0.x at or above 0.2.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/loomConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/loomConfig.cmake ${PROJECT_BINARY_DIR}/loomConfigVersion.cmake
  DESTINATION ${LOOM_INSTALL_CMAKEDIR})
