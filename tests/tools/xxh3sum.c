/* tera_xxh3sum FILE...: "SIZE HEX" per file (XXH3-64, as COMMIT and manifest.json record them), so
 * that a shell test can edit a file of a checkpoint and commit it again (the hand edit a damaged or
 * tampered checkpoint stands for). Exit status 1 when a file cannot be read. */
#include <stdio.h>
#include <stdlib.h>

#include <xxhash.h>

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            perror(argv[i]);
            return 1;
        }
        XXH3_state_t *st = XXH3_createState();
        if (!st) return 1;
        XXH3_64bits_reset(st);
        static char buf[1 << 16];
        long long n = 0;
        for (size_t k; (k = fread(buf, 1, sizeof buf, f)) > 0; n += (long long)k) XXH3_64bits_update(st, buf, k);
        const int bad = ferror(f);
        fclose(f);
        if (bad) {
            fprintf(stderr, "%s: read error\n", argv[i]);
            return 1;
        }
        printf("%lld %016llx\n", n, (unsigned long long)XXH3_64bits_digest(st));
        XXH3_freeState(st);
    }
    return 0;
}
