/* A dense matrix multiply with OpenMP: the compute job of the runtime benchmark
 * (bench/runtime_overhead.py). Prints the seconds the multiply itself took, so a launcher's
 * start-up is not counted.  Build: gcc -O2 -fopenmp -o matmul matmul.c   Run: ./matmul [N] */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1024;
    double *a = malloc(sizeof(double) * n * n), *b = malloc(sizeof(double) * n * n),
           *c = calloc((size_t)n * n, sizeof(double));
    if (!a || !b || !c) { perror("malloc"); return 1; }
    for (int i = 0; i < n * n; i++) { a[i] = (i % 7) * 0.5; b[i] = (i % 11) * 0.25; }
    double start = omp_get_wtime();
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++)
        for (int k = 0; k < n; k++) {
            double aik = a[i * n + k];
            for (int j = 0; j < n; j++) c[i * n + j] += aik * b[k * n + j];
        }
    double took = omp_get_wtime() - start;
    double sum = 0;
    for (int i = 0; i < n * n; i++) sum += c[i];
    printf("n=%d threads=%d seconds=%.4f checksum=%.1f\n", n, omp_get_max_threads(), took, sum);
    return 0;
}
