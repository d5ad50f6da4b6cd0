/* A fault for the Slurm tests: the first rank of a job to start MPI crashes there, as Open MPI 5.0's start-up race
 * under srun --mpi=pmix crashes one (docs/slurm-multi-node.md, "MPI_Init crash under srun").
 *
 * Loaded with LD_PRELOAD into every task of a job step, it stands in front of Open MPI's MPI_Init_thread (Horovod
 * starts MPI with it): it starts MPI, then, if the file HVREP_TEST_MPI_INIT_CRASH names does not exist yet, creates
 * it and raises SIGSEGV before returning. So exactly one rank of the job crashes, once, with MPI's start-up on its
 * stack: Open MPI's own handler prints the backtrace (this function, named MPI_Init_thread, in it) and srun reports
 * a segmentation fault, as in the real crash. A later start of the job finds the file and starts MPI as usual.
 * PMPI_Init_thread is looked up at run time, so the library loads into processes without MPI (the batch shell's
 * tools) and changes nothing there.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef int (*init_thread_fn)(int *, char ***, int, int *);

int MPI_Init_thread(int *argc, char ***argv, int required, int *provided) {
  /* Open MPI's library is loaded by then, but as a dependency of a module Python opened locally (Horovod's,
   * mpi4py's), so RTLD_NEXT does not see it: ask for the loaded library by name. */
  init_thread_fn real = (init_thread_fn)dlsym(RTLD_NEXT, "PMPI_Init_thread");
  const char *names[] = {"libmpi.so.40", "libmpi.so"};
  for (size_t i = 0; real == NULL && i < sizeof(names) / sizeof(names[0]); ++i) {
    void *lib = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD);
    if (lib != NULL) real = (init_thread_fn)dlsym(lib, "PMPI_Init_thread");
  }
  if (real == NULL) {
    fprintf(stderr, "mpi_init_crash: Open MPI's PMPI_Init_thread not found in this process\n");
    abort();
  }
  int rc = real(argc, argv, required, provided);
  const char *marker = getenv("HVREP_TEST_MPI_INIT_CRASH");
  if (marker != NULL && marker[0] != '\0') {
    int fd = open(marker, O_CREAT | O_EXCL | O_WRONLY, 0600);
    if (fd >= 0) { /* the first rank of the job to get here */
      close(fd);
      raise(SIGSEGV);
    }
  }
  return rc;
}
