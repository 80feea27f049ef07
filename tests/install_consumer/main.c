/* main.c - links against an installed libfsdp and checks that the header and
 * the library it loaded agree on the version. */
#include <stdio.h>

#include "fsdp.h"

int main(void) {
  if (fsdp_version() != FSDP_VERSION_NUMBER) {
    fprintf(stderr, "header version %d, library version %d\n", FSDP_VERSION_NUMBER, fsdp_version());
    return 1;
  }
  printf("%s\n", fsdp_build_info());
  return 0;
}
