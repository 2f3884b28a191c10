// A program linked against the library loads it by the name the SONAME gives, which carries the
// ABI version of the header it was compiled with (libnvfp4kv.so.MAJOR.MINOR, CMakeLists.txt):
// built against 0.1, it never starts with a 0.2 library, whose ABI may differ.
#include <dlfcn.h>
#include <stdio.h>

#include <string>

#include "nvfp4kv/nvfp4kv.h"

int main() {
  // A string of the library's own data: dladdr names the file that holds it (a function's
  // address could be a PLT entry of this executable).
  Dl_info info{};
  if (!dladdr(nvfp4kv_version_string(), &info) || !info.dli_fname) {
    fprintf(stderr, "dladdr found no library holding nvfp4kv_version_string()\n");
    return 1;
  }
  const std::string path = info.dli_fname;
  const std::string loaded = path.substr(path.rfind('/') + 1);
  const std::string expected = "libnvfp4kv.so." + std::to_string(NVFP4KV_VERSION_MAJOR) + "." +
                               std::to_string(NVFP4KV_VERSION_MINOR);
  if (loaded != expected) {
    fprintf(stderr, "loaded %s: the file name (the SONAME) should be %s\n", path.c_str(),
            expected.c_str());
    return 1;
  }
  printf("loaded %s\n", path.c_str());
  return 0;
}
