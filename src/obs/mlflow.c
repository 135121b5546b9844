/* MLflow REST client (include/tera/mlflow.h): experiments/get-by-name, experiments/create,
 * runs/create, runs/log-batch, runs/update, and artefact upload through the server's proxy
 * (PUT /api/2.0/mlflow-artifacts/artifacts/...) or a local file store. */
#include "tera/mlflow.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>

#include "tera/io.h"
#include "tera/status.h"

#define MLFLOW_MAX_METRICS 1000 /* runs/log-batch: at most 1000 metrics ... */
#define MLFLOW_MAX_PARAMS 100   /* ... 100 params and 100 tags per request */
#define MLFLOW_PARAM_MAX 6000   /* longest param value the server keeps */

struct tera_mlflow {
    char uri[1024];
    char run_id[128];
    char experiment_id[64];
    char artifact_uri[1024];
    int ok;
    CURL *curl;
    cJSON *metrics, *params, *tags; /* queued, arrays of {key, value[, timestamp, step]} */
    int n_metrics;
};

static int64_t now_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

/* The one warning of a run; the logger is off afterwards. */
static void mlflow_fail(tera_mlflow *m, const char *fmt, ...) {
    if (!m->ok) return;
    m->ok = 0;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "tera: warning: MLflow (%s): %s; no more MLflow logging for this run (training goes on)\n",
            m->uri, msg);
}

typedef struct {
    char *buf;
    size_t len, cap;
} grow_buf;

static size_t on_body(char *p, size_t size, size_t n, void *user) {
    grow_buf *b = user;
    const size_t k = size * n;
    if (b->len + k + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + k + 1) cap *= 2;
        char *nb = realloc(b->buf, cap);
        if (!nb) return 0;
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, p, k);
    b->len += k;
    b->buf[b->len] = '\0';
    return k;
}

/* One request: method GET/POST/PUT on uri + path with body (JSON unless raw_len >= 0: raw bytes).
 * Returns the parsed JSON answer (an empty object for an empty body), or NULL after mlflow_fail. */
static cJSON *request(tera_mlflow *m, const char *method, const char *path, const char *body, long raw_len) {
    if (!m->ok) return NULL;
    char url[4096];
    snprintf(url, sizeof url, "%s%s", m->uri, path);
    CURL *c = m->curl;
    curl_easy_reset(c);
    grow_buf got = {0};
    struct curl_slist *hdr = NULL;
    hdr = curl_slist_append(hdr, raw_len >= 0 ? "Content-Type: application/octet-stream" : "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &got);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 5L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L); /* called from the tracker thread */
    if (!strcmp(method, "POST")) {
        curl_easy_setopt(c, CURLOPT_POST, 1L);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body ? body : "{}");
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, raw_len >= 0 ? raw_len : (long)strlen(body ? body : "{}"));
    } else if (!strcmp(method, "PUT")) {
        curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, "PUT");
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, raw_len >= 0 ? raw_len : (long)strlen(body ? body : ""));
    }
    const CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(hdr);
    cJSON *ans = NULL;
    if (rc != CURLE_OK)
        mlflow_fail(m, "%s %s: %s", method, path, curl_easy_strerror(rc));
    else if (code < 200 || code >= 300)
        mlflow_fail(m, "%s %s: HTTP %ld: %.300s", method, path, code, got.buf ? got.buf : "");
    else if (!(ans = got.len ? cJSON_Parse(got.buf) : cJSON_CreateObject()))
        mlflow_fail(m, "%s %s: the answer is not JSON: %.200s", method, path, got.buf);
    free(got.buf);
    return ans;
}

static cJSON *post_json(tera_mlflow *m, const char *path, cJSON *body) {
    char *text = cJSON_PrintUnformatted(body);
    cJSON *ans = text ? request(m, "POST", path, text, -1) : NULL;
    free(text);
    return ans;
}

static const char *str_at(const cJSON *o, const char *a, const char *b, const char *c) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    if (b) x = cJSON_GetObjectItemCaseSensitive(x, b);
    if (c) x = cJSON_GetObjectItemCaseSensitive(x, c);
    return cJSON_IsString(x) ? x->valuestring : NULL;
}

tera_mlflow *tera_mlflow_start(const char *uri, const char *experiment, const char *run_name) {
    tera_mlflow *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    snprintf(m->uri, sizeof m->uri, "%s", uri);
    size_t n = strlen(m->uri);
    while (n > 0 && m->uri[n - 1] == '/') m->uri[--n] = '\0'; /* paths below start with '/' */
    m->ok = 1;
    m->curl = curl_easy_init();
    m->metrics = cJSON_CreateArray();
    m->params = cJSON_CreateArray();
    m->tags = cJSON_CreateArray();
    if (!m->curl || !m->metrics || !m->params || !m->tags) mlflow_fail(m, "out of memory");
    /* the experiment: found by name, else created */
    char *esc = m->ok ? curl_easy_escape(m->curl, experiment, 0) : NULL;
    char path[2048];
    snprintf(path, sizeof path, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=%s", esc ? esc : "");
    curl_free(esc);
    cJSON *ans = NULL;
    if (m->ok) {
        /* a missing experiment is an HTTP 404 here: asked quietly, then created */
        m->ok = 1;
        grow_buf got = {0};
        char url[4096];
        snprintf(url, sizeof url, "%s%s", m->uri, path);
        curl_easy_setopt(m->curl, CURLOPT_URL, url);
        curl_easy_setopt(m->curl, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(m->curl, CURLOPT_WRITEDATA, &got);
        curl_easy_setopt(m->curl, CURLOPT_CONNECTTIMEOUT, 5L);
        curl_easy_setopt(m->curl, CURLOPT_TIMEOUT, 30L);
        curl_easy_setopt(m->curl, CURLOPT_NOSIGNAL, 1L);
        const CURLcode rc = curl_easy_perform(m->curl);
        long code = 0;
        curl_easy_getinfo(m->curl, CURLINFO_RESPONSE_CODE, &code);
        if (rc != CURLE_OK) mlflow_fail(m, "cannot reach the server: %s", curl_easy_strerror(rc));
        else if (code == 200 && got.buf) ans = cJSON_Parse(got.buf);
        else if (code != 404 && !(got.buf && strstr(got.buf, "RESOURCE_DOES_NOT_EXIST")))
            mlflow_fail(m, "experiments/get-by-name: HTTP %ld: %.300s", code, got.buf ? got.buf : "");
        free(got.buf);
    }
    const char *eid = ans ? str_at(ans, "experiment", "experiment_id", NULL) : NULL;
    if (eid) snprintf(m->experiment_id, sizeof m->experiment_id, "%s", eid);
    cJSON_Delete(ans);
    if (m->ok && !eid) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "name", experiment);
        ans = post_json(m, "/api/2.0/mlflow/experiments/create", b);
        cJSON_Delete(b);
        eid = ans ? str_at(ans, "experiment_id", NULL, NULL) : NULL;
        if (eid) snprintf(m->experiment_id, sizeof m->experiment_id, "%s", eid);
        else mlflow_fail(m, "experiments/create gave no experiment_id");
        cJSON_Delete(ans);
    }
    if (m->ok) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "experiment_id", m->experiment_id);
        cJSON_AddStringToObject(b, "run_name", run_name);
        cJSON_AddNumberToObject(b, "start_time", (double)now_ms());
        ans = post_json(m, "/api/2.0/mlflow/runs/create", b);
        cJSON_Delete(b);
        const char *rid = ans ? str_at(ans, "run", "info", "run_id") : NULL;
        const char *art = ans ? str_at(ans, "run", "info", "artifact_uri") : NULL;
        if (rid) snprintf(m->run_id, sizeof m->run_id, "%s", rid);
        else mlflow_fail(m, "runs/create gave no run_id");
        if (art) snprintf(m->artifact_uri, sizeof m->artifact_uri, "%s", art);
        cJSON_Delete(ans);
    }
    if (!m->ok) {
        tera_mlflow_end(m, NULL);
        return NULL;
    }
    return m;
}

const char *tera_mlflow_run_id(const tera_mlflow *m) { return m ? m->run_id : ""; }
int tera_mlflow_ok(const tera_mlflow *m) { return m && m->ok; }

static void queue_kv(tera_mlflow *m, cJSON *arr, const char *key, const char *value) {
    if (!m || !m->ok) return;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "key", key);
    char v[MLFLOW_PARAM_MAX + 1];
    snprintf(v, sizeof v, "%s", value); /* longer values are cut to what the server keeps */
    cJSON_AddStringToObject(o, "value", v);
    cJSON_AddItemToArray(arr, o);
    if (cJSON_GetArraySize(arr) >= MLFLOW_MAX_PARAMS) tera_mlflow_flush(m);
}

void tera_mlflow_param(tera_mlflow *m, const char *key, const char *value) { if (m) queue_kv(m, m->params, key, value); }
void tera_mlflow_tag(tera_mlflow *m, const char *key, const char *value) { if (m) queue_kv(m, m->tags, key, value); }

void tera_mlflow_metric(tera_mlflow *m, const char *key, double value, int64_t step, int64_t timestamp_ms) {
    if (!m || !m->ok) return;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "key", key);
    cJSON_AddNumberToObject(o, "value", value);
    cJSON_AddNumberToObject(o, "timestamp", (double)timestamp_ms);
    cJSON_AddNumberToObject(o, "step", (double)step);
    cJSON_AddItemToArray(m->metrics, o);
    if (++m->n_metrics >= MLFLOW_MAX_METRICS) tera_mlflow_flush(m);
}

void tera_mlflow_flush(tera_mlflow *m) {
    if (!m || !m->ok) return;
    if (!m->n_metrics && !cJSON_GetArraySize(m->params) && !cJSON_GetArraySize(m->tags)) return;
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "run_id", m->run_id);
    cJSON_AddItemToObject(b, "metrics", m->metrics);
    cJSON_AddItemToObject(b, "params", m->params);
    cJSON_AddItemToObject(b, "tags", m->tags);
    m->metrics = cJSON_CreateArray();
    m->params = cJSON_CreateArray();
    m->tags = cJSON_CreateArray();
    m->n_metrics = 0;
    cJSON_Delete(post_json(m, "/api/2.0/mlflow/runs/log-batch", b));
    cJSON_Delete(b);
}

void tera_mlflow_artifact(tera_mlflow *m, const char *local_path, const char *name) {
    if (!m || !m->ok) return;
    char *data = NULL;
    if (tera_read_text_file(local_path, &data) != TERA_OK) {
        mlflow_fail(m, "artefact %s: %s", local_path, tera_last_error());
        return;
    }
    const char *proxy = "mlflow-artifacts:";
    char path[4096];
    if (!strncmp(m->artifact_uri, proxy, strlen(proxy))) { /* the server's artefact proxy */
        const char *rest = m->artifact_uri + strlen(proxy);
        while (*rest == '/') rest++;
        snprintf(path, sizeof path, "/api/2.0/mlflow-artifacts/artifacts/%s/%s", rest, name);
        cJSON_Delete(request(m, "PUT", path, data, (long)strlen(data)));
    } else if (m->artifact_uri[0] == '/' || !strncmp(m->artifact_uri, "file://", 7)) { /* a local store */
        const char *dir = m->artifact_uri[0] == '/' ? m->artifact_uri : m->artifact_uri + 7;
        snprintf(path, sizeof path, "%s/%s", dir, name);
        FILE *f = NULL;
        if (tera_mkdirs(dir) != TERA_OK || !(f = fopen(path, "w")) || fputs(data, f) < 0)
            mlflow_fail(m, "artefact %s -> %s: %s", local_path, path, strerror(errno));
        if (f && fclose(f) != 0) mlflow_fail(m, "artefact %s: %s", path, strerror(errno));
    } else {
        mlflow_fail(m, "artefact store %s: only mlflow-artifacts:/ (mlflow server's proxy) and local paths are "
                    "supported", m->artifact_uri);
    }
    free(data);
}

void tera_mlflow_end(tera_mlflow *m, const char *status) {
    if (!m) return;
    if (status && m->ok) {
        tera_mlflow_flush(m);
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "run_id", m->run_id);
        cJSON_AddStringToObject(b, "status", status);
        cJSON_AddNumberToObject(b, "end_time", (double)now_ms());
        cJSON_Delete(post_json(m, "/api/2.0/mlflow/runs/update", b));
        cJSON_Delete(b);
    }
    if (m->curl) curl_easy_cleanup(m->curl);
    cJSON_Delete(m->metrics);
    cJSON_Delete(m->params);
    cJSON_Delete(m->tags);
    free(m);
}
