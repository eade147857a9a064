/* A program around engine/host_adam.c, so that a build for another CPU (aarch64) runs under qemu-user where
 * Python and torch are not: tests/test_native_builds.py writes the state and each step's arguments to a file,
 * this program runs dos_host_adam over them and writes the state and the cast copy back.
 *
 * Input (native byte order, 4-byte floats and ints): int64 numel; int32 lp_kind, threads, steps; param,
 * exp_avg, exp_avg_sq (numel floats each); then per step: the eleven scalars of dos_host_adam from inv_scale
 * to neg_step_size (float, int, float, float, int, then six floats) and the step's gradient (numel floats).
 * Output: param, exp_avg, exp_avg_sq, then the copy (numel elements of 2 or 4 bytes; none for lp_kind 0). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int dos_host_adam(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, void *lp, int lp_kind,
                  int64_t numel, float inv_scale, int decoupled, float decay_factor, float weight_decay,
                  int lerp_small, float lerp_coeff, float beta2, float sq_coeff, float bc2_sqrt, float eps,
                  float neg_step_size, int threads);

static void read_exactly(FILE *in, void *buffer, size_t size) {
    if (fread(buffer, 1, size, in) != size) {
        fprintf(stderr, "host_adam_main: input too short\n");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: host_adam_main INPUT OUTPUT\n");
        return 2;
    }
    FILE *in = fopen(argv[1], "rb");
    if (in == NULL) return 2;
    int64_t numel;
    int32_t header[3];
    read_exactly(in, &numel, sizeof numel);
    read_exactly(in, header, sizeof header);
    int lp_kind = header[0], threads = header[1], steps = header[2];
    size_t lp_size = lp_kind == 0 ? 0 : lp_kind == 3 ? 4 : 2;
    float *state[3];
    for (int k = 0; k < 3; k++) {
        state[k] = malloc(numel * sizeof(float));
        read_exactly(in, state[k], numel * sizeof(float));
    }
    float *grad = malloc(numel * sizeof(float));
    void *lp = lp_size ? malloc(numel * lp_size) : NULL;
    for (int s = 0; s < steps; s++) {
        union {
            float f;
            int32_t i;
        } a[11];
        read_exactly(in, a, sizeof a);
        read_exactly(in, grad, numel * sizeof(float));
        dos_host_adam(state[0], grad, state[1], state[2], lp, lp_kind, numel, a[0].f, a[1].i, a[2].f, a[3].f,
                      a[4].i, a[5].f, a[6].f, a[7].f, a[8].f, a[9].f, a[10].f, threads);
    }
    fclose(in);
    FILE *out = fopen(argv[2], "wb");
    if (out == NULL) return 2;
    for (int k = 0; k < 3; k++) fwrite(state[k], sizeof(float), numel, out);
    if (lp_size) fwrite(lp, lp_size, numel, out);
    return fclose(out) == 0 ? 0 : 2;
}
