/* LoRA's update as a job (lora.c): y[:rows, :n] += round((x A^T) Bt), x [rows, k] at ldx, A [r, k], Bt [r, n]
 * fp32, y at ldy; x and y of the caller's row type. Shared by lora.c and decoder.c. */
#ifndef CONSORT_KERNELS_LORA_H
#define CONSORT_KERNELS_LORA_H
#include <stdint.h>

typedef struct {
    const void *x;
    int64_t ldx, rows, k;
    const float *a, *bt;
    int64_t r, n;
    void *y;
    int64_t ldy;
} lora_job_t;

#endif
