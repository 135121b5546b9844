/* Hardware readings from /proc and /sys (include/tera/hw.h).
 *
 * Sensors are found at the first sample: hwmon chips (/sys/class/hwmon/hwmonN/name, tempK_input,
 * tempK_label) and RAPL domains (/sys/class/powercap/intel-rapl:*: name, energy_uj,
 * max_energy_range_uj), with their paths kept in fixed arrays. Rates (CPU utilisation, power) need
 * two samples: they are absent from the first. Files are read with open/read into stack buffers. */
#include "tera/hw.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_TEMPS 16
#define MAX_RAPL 8

static struct {
    int found;
    int n_temp, n_rapl;
    char temp_path[MAX_TEMPS][160], temp_label[MAX_TEMPS][48];
    char rapl_path[MAX_RAPL][160], rapl_label[MAX_RAPL][48];
    double rapl_max[MAX_RAPL], rapl_prev[MAX_RAPL];
    double prev_cpu, prev_wall; /* 0: none yet */
    double last_try;
    int ncpu;
    tera_hw_reading latest;
} g;

/* The whole (small) file into buf, NUL-terminated; -1 when it cannot be read. */
static int slurp(const char *path, char *buf, size_t cap) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t len = 0;
    for (;;) {
        const ssize_t k = read(fd, buf + len, cap - 1 - len);
        if (k <= 0) break;
        len += (size_t)k;
        if (len == cap - 1) break;
    }
    close(fd);
    buf[len] = 0;
    return (int)len;
}

static double read_num(const char *path, int *ok) {
    char b[64];
    *ok = 0;
    if (slurp(path, b, sizeof b) <= 0) return 0;
    char *end;
    const double v = strtod(b, &end);
    *ok = end != b;
    return v;
}

static void trim(char *s) {
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\n' || s[n - 1] == ' ')) s[--n] = 0;
    for (char *p = s; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' || *p == '-'))
            *p = '_';
}

static void find_sensors(void) {
    g.found = 1;
    cpu_set_t set;
    g.ncpu = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (g.ncpu < 1) g.ncpu = 1;
    char path[160], b[128];
    for (int h = 0; h < 64 && g.n_temp < MAX_TEMPS; h++) {
        snprintf(path, sizeof path, "/sys/class/hwmon/hwmon%d/name", h);
        char chip[48];
        if (slurp(path, chip, sizeof chip) <= 0) continue;
        trim(chip);
        for (int t = 1; t < 32 && g.n_temp < MAX_TEMPS; t++) {
            snprintf(path, sizeof path, "/sys/class/hwmon/hwmon%d/temp%d_input", h, t);
            int ok;
            read_num(path, &ok);
            if (!ok) continue;
            snprintf(g.temp_path[g.n_temp], sizeof g.temp_path[0], "%s", path);
            snprintf(path, sizeof path, "/sys/class/hwmon/hwmon%d/temp%d_label", h, t);
            if (slurp(path, b, sizeof b) > 0) trim(b);
            else snprintf(b, sizeof b, "temp%d", t);
            snprintf(g.temp_label[g.n_temp], sizeof g.temp_label[0], "%.20s_%.24s", chip, b);
            g.n_temp++;
        }
    }
    DIR *d = opendir("/sys/class/powercap");
    if (d) { /* set-up (the first sample): opendir's allocation is once */
        struct dirent *e;
        while ((e = readdir(d)) && g.n_rapl < MAX_RAPL) {
            if (strncmp(e->d_name, "intel-rapl:", 11)) continue;
            int ok;
            snprintf(path, sizeof path, "/sys/class/powercap/%.100s/energy_uj", e->d_name);
            const double v = read_num(path, &ok);
            if (!ok) continue; /* not readable (no permission): absent */
            snprintf(g.rapl_path[g.n_rapl], sizeof g.rapl_path[0], "%s", path);
            g.rapl_prev[g.n_rapl] = v;
            snprintf(path, sizeof path, "/sys/class/powercap/%.100s/max_energy_range_uj", e->d_name);
            g.rapl_max[g.n_rapl] = read_num(path, &ok);
            if (!ok) g.rapl_max[g.n_rapl] = 0;
            snprintf(path, sizeof path, "/sys/class/powercap/%.100s/name", e->d_name);
            if (slurp(path, b, sizeof b) > 0) trim(b);
            else b[0] = 0;
            snprintf(g.rapl_label[g.n_rapl], sizeof g.rapl_label[0], "%.20s_%.20s", e->d_name + 11, b);
            g.n_rapl++;
        }
        closedir(d);
    }
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void add(tera_hw_reading *r, tera_hw_kind k, const char *name, const char *label, double v) {
    if (r->n >= TERA_HW_MAX) return;
    r->kind[r->n] = k;
    snprintf(r->name[r->n], sizeof r->name[0], "%s%s%s", name, label[0] ? "/" : "", label);
    snprintf(r->label[r->n], sizeof r->label[0], "%s", label);
    r->value[r->n] = v;
    r->n++;
}

/* "Key:   N kB" of /proc/meminfo in bytes, -1 when absent. */
static double meminfo_bytes(const char *text, const char *key) {
    const char *p = strstr(text, key);
    if (!p) return -1;
    return 1024.0 * strtod(p + strlen(key), NULL);
}

static void read_into(tera_hw_reading *r) {
    if (!g.found) find_sensors();
    r->n = 0;
    const double wall = wall_now();
    struct timespec cts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cts);
    const double cpu = (double)cts.tv_sec + 1e-9 * (double)cts.tv_nsec;
    if (g.prev_wall > 0 && wall > g.prev_wall) {
        const double cores = (cpu - g.prev_cpu) / (wall - g.prev_wall);
        add(r, TERA_HW_CPU_UTIL, "cpu_utilization", "", cores / g.ncpu);
        add(r, TERA_HW_CPU_CORES, "cpu_cores_used", "", cores);
    }
    char buf[8192];
    if (slurp("/proc/self/statm", buf, sizeof buf) > 0) {
        long size = 0, res = 0;
        if (sscanf(buf, "%ld %ld", &size, &res) == 2) add(r, TERA_HW_RSS, "rss_bytes", "", (double)res * (double)sysconf(_SC_PAGESIZE));
    }
    if (slurp("/proc/meminfo", buf, sizeof buf) > 0) {
        const double v = meminfo_bytes(buf, "MemAvailable:");
        if (v >= 0) add(r, TERA_HW_MEM_AVAIL, "mem_available_bytes", "", v);
    }
    if (slurp("/proc/net/dev", buf, sizeof buf) > 0) {
        double rx = 0, tx = 0;
        int any = 0;
        char *save = NULL;
        for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            char *colon = strchr(line, ':');
            if (!colon) continue; /* the two header lines */
            *colon = 0;
            const char *ifn = line;
            while (*ifn == ' ') ifn++;
            if (!strcmp(ifn, "lo")) continue;
            unsigned long long v[9];
            if (sscanf(colon + 1, "%llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                       &v[6], &v[7], &v[8]) == 9)
                rx += (double)v[0], tx += (double)v[8], any = 1;
        }
        if (any) {
            add(r, TERA_HW_NET_RX, "net_rx_bytes", "", rx);
            add(r, TERA_HW_NET_TX, "net_tx_bytes", "", tx);
        }
    }
    for (int i = 0; i < g.n_temp; i++) {
        int ok;
        const double v = read_num(g.temp_path[i], &ok);
        if (ok) add(r, TERA_HW_TEMP, "temp_celsius", g.temp_label[i], v / 1000.0);
    }
    for (int i = 0; i < g.n_rapl; i++) {
        int ok;
        const double v = read_num(g.rapl_path[i], &ok);
        if (!ok) continue;
        double d = v - g.rapl_prev[i];
        if (d < 0 && g.rapl_max[i] > 0) d += g.rapl_max[i]; /* the counter wrapped */
        if (g.prev_wall > 0 && wall > g.prev_wall && d >= 0)
            add(r, TERA_HW_POWER, "power_watts", g.rapl_label[i], 1e-6 * d / (wall - g.prev_wall));
        g.rapl_prev[i] = v;
    }
    g.prev_cpu = cpu, g.prev_wall = wall;
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    r->unix_time = (double)rt.tv_sec + 1e-9 * (double)rt.tv_nsec;
}

void tera_hw_sample(double min_interval_s) {
    const double now = wall_now();
    if (g.last_try > 0 && now - g.last_try < min_interval_s) return;
    g.last_try = now;
    read_into(&g.latest);
}

const tera_hw_reading *tera_hw_latest(void) { return &g.latest; }

void tera_hw_read_now(tera_hw_reading *out) { read_into(out); }

/* ---- machine memory (hw.h) */
double tera_hw_meminfo(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    double v = -1;
    const size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && line[kl] == ':') {
            v = 1024.0 * strtod(line + kl + 1, NULL);
            break;
        }
    fclose(f);
    return v;
}

/* the first number of a one-line file; -1 when absent, unreadable or not a number ("max") */
static double file_number(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[64] = "";
    const int ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    char *end;
    const double v = ok ? strtod(line, &end) : -1;
    return ok && end != line && v >= 0 ? v : -1;
}

static const char *const cg_limit[2] = {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
static const char *const cg_usage[2] = {"/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"};

double tera_hw_memory_limit(void) {
    double total = tera_hw_meminfo("MemTotal");
    for (int i = 0; i < 2; i++) {
        const double v = file_number(cg_limit[i]);
        if (v > 0 && (total < 0 || v < total)) total = v;
        if (v >= 0 || access(cg_limit[i], F_OK) == 0) break; /* the first hierarchy present decides */
    }
    return total;
}

double tera_hw_memory_available(void) {
    double avail = tera_hw_meminfo("MemAvailable");
    for (int i = 0; i < 2; i++) { /* an unlimited v1 group reports a limit past any use: no effect */
        const double l = file_number(cg_limit[i]), u = file_number(cg_usage[i]);
        if (l > 0 && u >= 0) {
            const double left = l > u ? l - u : 0;
            if (avail < 0 || left < avail) avail = left;
            break;
        }
    }
    return avail;
}
