/* Where a thread's OpenMP team starts out.
 *
 * libgomp creates a thread's team the first time the thread runs a parallel region, and Linux may first run
 * the new threads beside their creator, on one core, until its load balancer spreads them some milliseconds
 * later; meanwhile every barrier waits for a thread that is not running. On a new thread the first forward
 * pass of a 30-token prompt took 1.5x its later ones; with the team pinned one thread to a core (libgomp's
 * OMP_PROC_BIND) or spread by this function first, it took what they did. spread_team runs one region that
 * pins each thread of the team to a CPU of its own (of those the caller may run on), then lets each run on
 * any of them again, so the team starts spread and the scheduler has no reason to gather it.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Returns the CPUs the caller may run on, or -1 where the system would not say. */
int spread_team(int num_threads) {
#ifdef __linux__
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed)) return -1;
    int cpus[CPU_SETSIZE], n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
#pragma omp parallel num_threads(num_threads)
    {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[omp_get_thread_num() % n], &one);
        sched_setaffinity(0, sizeof one, &one);
#pragma omp barrier
        sched_setaffinity(0, sizeof allowed, &allowed);
    }
    return n;
#else
    (void)num_threads;
    return -1;
#endif
}
