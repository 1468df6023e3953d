/* Monotone convex-hull-trick DP for one-sided weighted k-median on a line.
 *
 * C fast path of sglang_sparse/placement/dp.py:solve_dp_python (same algorithm, same
 * tie-breaking); see that module for the recurrence. Called through ctypes; the PyInit stub only
 * lets setuptools build and locate the shared object.
 *
 * n points (0 = origin), P[n] positions, SM[n+1], SW[n+1] prefix sums of moments and masses.
 * mstar >= 1 checkpoints. parent[(mstar+1)*n], work[2n], hull[n] scratch; chosen[mstar] output
 * (point indices, deepest first). Returns 0 on success, 1 if no feasible solution.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int spc_cht_solve(int64_t n, const double *P, const double *SM, const double *SW, int64_t mstar,
                  int64_t *parent, double *work, int64_t *hull, int64_t *chosen) {
    /* work holds prev[n], cur[n]; line intercepts reuse the hull slots through b[] below. */
    double *prev = work, *cur = work + n;
    double *b = (double *)malloc((size_t)n * sizeof(double));
    if (!b) return 2;
    for (int64_t i = 0; i < n; i++) prev[i] = INFINITY;
    prev[0] = 0.0;
    for (int64_t m = 1; m <= mstar; m++) {
        int64_t len = 0, ptr = 0;
        int64_t *par = parent + m * n;
        for (int64_t i = 0; i < m && i < n; i++) cur[i] = INFINITY;
        for (int64_t a = m; a < n; a++) {
            int64_t ap = a - 1;
            double g = prev[ap];
            if (g < INFINITY) {
                double k3 = -P[ap], b3 = g - SM[ap] + P[ap] * SW[ap];
                b[ap] = b3;
                while (len >= 2) {
                    int64_t i1 = hull[len - 2], i2 = hull[len - 1];
                    double k1 = -P[i1], b1 = b[i1], k2 = -P[i2], b2 = b[i2];
                    if ((b3 - b1) * (k1 - k2) <= (b2 - b1) * (k1 - k3)) len--;
                    else break;
                }
                hull[len++] = ap;
                if (ptr >= len) ptr = len - 1;
            }
            if (len == 0) { cur[a] = INFINITY; continue; }
            double x = SW[a];
            while (ptr + 1 < len) {
                int64_t i0 = hull[ptr], i1 = hull[ptr + 1];
                if (-P[i1] * x + b[i1] <= -P[i0] * x + b[i0]) ptr++;
                else break;
            }
            int64_t best = hull[ptr];
            cur[a] = SM[a] + (-P[best] * x + b[best]);
            par[a] = best;
        }
        double *t = prev; prev = cur; cur = t;
    }
    free(b);
    int64_t a = -1;
    double bestc = INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (!(prev[i] < INFINITY)) continue;
        double c = prev[i] + (SM[n] - SM[i]) - P[i] * (SW[n] - SW[i]);
        if (c < bestc) { bestc = c; a = i; }
    }
    if (a < 0) return 1;
    for (int64_t m = mstar; m >= 1; m--) {
        chosen[mstar - m] = a;
        a = parent[m * n + a];
    }
    return 0;
}

static struct PyModuleDef spc_module = {PyModuleDef_HEAD_INIT, "_cht_native",
                                        "C fast path of the placement DP (used via ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__cht_native(void) { return PyModule_Create(&spc_module); }
