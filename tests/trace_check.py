"""Checks a tera timeline (logging.trace) against the Chrome trace-event format: used by tests/cli_trace.sh.
Usage: trace_check.py FILE RANKS FIRST COUNT [REQUIRED_TIDS]   (REQUIRED_TIDS: comma list, e.g. 0,1,2,3)
Prints one summary line; exits 1 with the reason on the first violation."""
import json, sys

path, ranks, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
need_tids = [int(t) for t in sys.argv[5].split(",")] if len(sys.argv) > 5 and sys.argv[5] else [0]


def die(msg):
    print("FAIL: " + msg)
    sys.exit(1)


with open(path) as f:
    doc = json.load(f)  # valid JSON (the object form of the format)
evs = doc.get("traceEvents")
if not isinstance(evs, list) or not evs:
    die("no traceEvents array")
meta = {}
by = {}
for e in evs:
    for k in ("name", "ph", "pid", "tid"):
        if k not in e:
            die("event without %s: %s" % (k, e))
    if e["ph"] == "M":
        if e["name"] in ("process_name", "thread_name"):
            if "name" not in e.get("args", {}):
                die("metadata without args.name: %s" % e)
            meta[(e["name"], e["pid"], e["tid"] if e["name"] == "thread_name" else 0)] = e["args"]["name"]
        continue
    if e["ph"] != "X":
        die("unexpected phase %s" % e["ph"])
    for k in ("ts", "dur", "cat", "args"):
        if k not in e:
            die("X event without %s: %s" % (k, e))
    if not isinstance(e["ts"], (int, float)) or not isinstance(e["dur"], (int, float)) or e["dur"] < 0:
        die("bad ts/dur: %s" % e)
    s = e["args"].get("step")
    if not isinstance(s, int) or not (first <= s < first + count):
        die("event outside the window %d:%d: %s" % (first, count, e))
    by.setdefault((e["pid"], e["tid"]), []).append(e)
pids = sorted({p for p, _ in by})
if pids != list(range(ranks)):
    die("pids %s, expected ranks 0..%d" % (pids, ranks - 1))
n_nested = 0
for (pid, tid), lst in by.items():
    if ("thread_name", pid, tid) not in meta or ("process_name", pid, 0) not in meta:
        die("no name metadata for pid %d tid %d" % (pid, tid))
    prev = None
    stack = []
    for e in lst:  # in file order: sorted by start, enclosing first
        ts, end = e["ts"], e["ts"] + e["dur"]
        if prev is not None and ts < prev:
            die("pid %d tid %d: events out of order (%s after %s)" % (pid, tid, ts, prev))
        prev = ts
        while stack and stack[-1] <= ts + 1e-6:  # ends where the next begins (printed to 1 ns)
            stack.pop()
        if stack and end > stack[-1] + 1e-6:
            die("pid %d tid %d: %s [%s, %s] overlaps its enclosing event ending at %s" % (pid, tid, e["name"], ts, end, stack[-1]))
        if stack:
            n_nested += 1
        stack.append(end)
for pid in pids:
    for t in need_tids:
        if (pid, t) not in by:
            die("rank %d has no events on tid %d (%s)" % (pid, t, meta.get(("thread_name", pid, t), "?")))
    steps = sorted({e["args"]["step"] for e in by[(pid, 0)] if e["name"] == "step"})
    if steps != list(range(first, first + count)):
        die("rank %d: step events %s, expected %d..%d" % (pid, steps, first, first + count - 1))
names = sorted({e["name"] for l in by.values() for e in l})
print("%d events, %d ranks, %d threads, %d nested, names: %s" % (sum(len(l) for l in by.values()), len(pids), len(by),
                                                                   n_nested, ", ".join(names)))
