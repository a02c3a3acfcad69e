/* The team size of every parallel region of the kernels (see common.h). */
#include "common.h"

int kernel_threads = 0;

void set_num_threads(int n) { kernel_threads = n; }

/* The team size a parallel region of these kernels gets (tests check the plan reaches every thread). */
int team_size(void) {
    int n = 0;
    _Pragma("omp parallel num_threads(NT)")
    _Pragma("omp single")
    n = omp_get_num_threads();
    return n;
}
