# The README's C program compiles as written (C99, pedantic, warnings as
# errors) against the public header and libfsdp.so, runs, and learns (its
# exit status). Takes the first ```c block of README.md.
#   cmake -DREADME=... -DWORK=... -DCC=... -DCFLAGS=... -DINCLUDE=... -DLIBDIR=... -P check_readme_snippet.cmake
file(READ ${README} text)
string(FIND "${text}" "```c\n" begin)
if(begin EQUAL -1)
  message(FATAL_ERROR "README.md has no ```c block")
endif()
math(EXPR begin "${begin} + 5")
string(SUBSTRING "${text}" ${begin} -1 rest)
string(FIND "${rest}" "```" end)
string(SUBSTRING "${rest}" 0 ${end} program)
file(MAKE_DIRECTORY ${WORK})
file(WRITE ${WORK}/quickstart.c "${program}")
separate_arguments(flags UNIX_COMMAND "${CFLAGS}")  # the build's own (sanitizers)
execute_process(COMMAND ${CC} ${flags} -std=c99 -pedantic -Wall -Wextra -Werror ${WORK}/quickstart.c -I${INCLUDE} -L${LIBDIR}
                        -Wl,-rpath,${LIBDIR} -lfsdp -o ${WORK}/quickstart
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the README's C program does not compile:\n${err}")
endif()
execute_process(COMMAND ${WORK}/quickstart RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "step 100")
  message(FATAL_ERROR "the README's C program failed (exit ${rc}):\n${out}${err}")
endif()
