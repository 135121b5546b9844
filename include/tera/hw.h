/* Hardware readings (src/obs/hw.c, docs/MONITORING.md): this process's CPU utilisation, its resident
 * memory, the machine's available memory, network bytes (every interface but loopback), hwmon
 * temperatures and RAPL power, read from /proc and /sys. A reading the machine does not expose is
 * absent from the list (never reported as zero). The step thread samples at most once a second
 * (tera_hw_sample, called once per step); reading uses open/read into fixed buffers, no allocation. */
#ifndef TERA_HW_H
#define TERA_HW_H

#define TERA_HW_MAX 40

typedef enum {
    TERA_HW_CPU_UTIL,  /* CPU time of this process / (wall time x CPUs it may use), 0..1 */
    TERA_HW_CPU_CORES, /* CPU time of this process / wall time: cores busy */
    TERA_HW_RSS,       /* resident set size, bytes */
    TERA_HW_MEM_AVAIL, /* the machine's MemAvailable, bytes */
    TERA_HW_NET_RX,    /* bytes received since boot, all interfaces but lo (a counter) */
    TERA_HW_NET_TX,    /* bytes sent since boot (a counter) */
    TERA_HW_TEMP,      /* a hwmon temperature, degrees Celsius (label: chip_sensor) */
    TERA_HW_POWER,     /* a RAPL domain's mean power since the previous sample, watts (label: domain) */
} tera_hw_kind;

typedef struct {
    int n;
    tera_hw_kind kind[TERA_HW_MAX];
    char name[TERA_HW_MAX][64];  /* metrics.jsonl key: cpu_utilization, rss_bytes, temp_celsius/<label>, ... */
    char label[TERA_HW_MAX][48]; /* sensor or domain ("" for the others) */
    double value[TERA_HW_MAX];
    double unix_time;            /* when sampled (0: never) */
} tera_hw_reading;

/* Samples now if the last sample is older than min_interval_s (the step thread; no allocation). */
void tera_hw_sample(double min_interval_s);
/* The latest sample (the step thread, or after it; empty before the first). */
const tera_hw_reading *tera_hw_latest(void);
/* A sample into *out now (tests); rates against the previous sample of either function. */
void tera_hw_read_now(tera_hw_reading *out);

/* Memory of the machine (reads /proc and /sys; callable any time, not for the step loop):
 * tera_hw_meminfo: a "Key: N kB" line of /proc/meminfo in bytes (-1: absent);
 * tera_hw_memory_limit: what this process may use: the cgroup's limit (v2 memory.max, v1
 *   limit_in_bytes) when below MemTotal, else MemTotal (-1: unknown);
 * tera_hw_memory_available: what can still be allocated: MemAvailable, or less where a cgroup limit
 *   leaves less (its limit minus its current use) (-1: unknown). */
double tera_hw_meminfo(const char *key);
double tera_hw_memory_limit(void);
double tera_hw_memory_available(void);

#endif
