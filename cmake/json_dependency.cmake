# libloom's header-only JSON dependency (tuning cache, benchmark JSON), also for builds from
# source through pip (CMakeLists.txt includes this file).
#
# nlohmann_json: the system's when find_package finds it; else the headers of the `nlohmann-json`
# PyPI package, which pyproject.toml lists as a build requirement (it ships no CMake files, so an
# imported target is defined here and find_package is redirected to it). OpenSSL's libcrypto is
# not header-only: it stays a system requirement (libssl-dev to build, libcrypto.so.3 to run).
find_package(nlohmann_json 3.10 CONFIG QUIET)
if(NOT nlohmann_json_FOUND)
  find_package(Python 3.9 REQUIRED COMPONENTS Interpreter)
  # Located without importing the package (its __init__ imports a backport it does not declare).
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import importlib.util, os; s = importlib.util.find_spec('nlohmann_json'); print(os.path.join(list(s.submodule_search_locations)[0], 'include'))"
    OUTPUT_VARIABLE loom_wheel_json_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT loom_wheel_json_include OR NOT EXISTS "${loom_wheel_json_include}/nlohmann/json.hpp")
    message(FATAL_ERROR "nlohmann_json (>= 3.10) not found: install the system package (nlohmann-json3-dev) "
                        "or `pip install nlohmann-json` into the build environment")
  endif()
  # The version macros: detail/abi_macros.hpp in the multi-header layout, json.hpp in the single one.
  set(loom_wheel_json_header "${loom_wheel_json_include}/nlohmann/detail/abi_macros.hpp")
  if(NOT EXISTS "${loom_wheel_json_header}")
    set(loom_wheel_json_header "${loom_wheel_json_include}/nlohmann/json.hpp")
  endif()
  file(STRINGS "${loom_wheel_json_header}" loom_wheel_json_version
       REGEX "#define NLOHMANN_JSON_VERSION_(MAJOR|MINOR|PATCH) [0-9]+")
  string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
         loom_wheel_json_version "${loom_wheel_json_version}")
  message(STATUS "nlohmann_json ${loom_wheel_json_version}: the nlohmann-json PyPI package's headers (${loom_wheel_json_include})")
  # find_package looks in CMAKE_FIND_PACKAGE_REDIRECTS_DIR before anywhere else (CMake >= 3.24).
  file(WRITE "${CMAKE_FIND_PACKAGE_REDIRECTS_DIR}/nlohmann_json-config.cmake"
       "if(NOT TARGET nlohmann_json::nlohmann_json)\n"
       "  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)\n"
       "  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES \"${loom_wheel_json_include}\")\n"
       "endif()\n")
  file(WRITE "${CMAKE_FIND_PACKAGE_REDIRECTS_DIR}/nlohmann_json-config-version.cmake"
       "set(PACKAGE_VERSION ${loom_wheel_json_version})\n"
       "if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)\n"
       "  set(PACKAGE_VERSION_COMPATIBLE FALSE)\n"
       "else()\n"
       "  set(PACKAGE_VERSION_COMPATIBLE TRUE)\n"
       "endif()\n")
endif()
