/* A program around engine/host_adam.c, so that a build for another CPU (aarch64) runs under qemu-user where
 * Python and torch are not: tests/test_native_builds.py writes the state and each step's arguments to a file,
 * this program runs dos_host_update over them and writes the state and the cast copy back.
 *
 * Input (native byte order, 4-byte floats and ints): int64 numel; int32 rule, dtypes, lp_kind, threads, steps,
 * states (the rule's state count); param, then each state (numel elements each, 4 bytes or bf16's 2 as dtypes
 * says); then per step: float inv_scale, the Step struct of host_adam.c (twelve 4-byte fields) and the step's
 * gradient (numel elements of param's size).
 * Output: param, each state, then the copy (numel elements of 2 or 4 bytes; none for lp_kind 0). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    int32_t fields[12]; /* host_adam.c's Step: ints and floats, 4 bytes each, passed through as they came */
} Step;

int dos_host_update(int rule, int dtypes, void *param, const void *grad, void *state0, void *state1,
                    void *param_out, void *state0_out, void *state1_out, void *lp, int lp_kind, int64_t numel,
                    float inv_scale, const Step *step, int threads);

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
    int32_t header[6];
    read_exactly(in, &numel, sizeof numel);
    read_exactly(in, header, sizeof header);
    int rule = header[0], dtypes = header[1], lp_kind = header[2], threads = header[3], steps = header[4];
    int states = header[5];
    if (states < 1 || states > 2) return 2;
    size_t master_size = dtypes == 0 ? 4 : 2, state_size = dtypes == 2 ? 2 : 4;
    size_t lp_size = lp_kind == 0 ? 0 : lp_kind == 3 ? 4 : 2;
    void *param = malloc(numel * master_size);
    read_exactly(in, param, numel * master_size);
    void *state[2] = {NULL, NULL};
    for (int k = 0; k < states; k++) {
        state[k] = malloc(numel * state_size);
        read_exactly(in, state[k], numel * state_size);
    }
    void *grad = malloc(numel * master_size);
    void *lp = lp_size ? malloc(numel * lp_size) : NULL;
    for (int s = 0; s < steps; s++) {
        float inv_scale;
        Step step;
        read_exactly(in, &inv_scale, sizeof inv_scale);
        read_exactly(in, &step, sizeof step);
        read_exactly(in, grad, numel * master_size);
        if (dos_host_update(rule, dtypes, param, grad, state[0], state[1], NULL, NULL, NULL, lp, lp_kind, numel,
                            inv_scale, &step, threads) != 0)
            return 3;
    }
    fclose(in);
    FILE *out = fopen(argv[2], "wb");
    if (out == NULL) return 2;
    fwrite(param, master_size, numel, out);
    for (int k = 0; k < states; k++) fwrite(state[k], state_size, numel, out);
    if (lp_size) fwrite(lp, lp_size, numel, out);
    return fclose(out) == 0 ? 0 : 2;
}
