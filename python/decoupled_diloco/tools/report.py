"""Summarises a run folder written by scripts/run-local: PNG plots and one page (index.md and
index.html) with the configuration, the headline numbers, the plots and the text sample.

Run it as scripts/report (or diloco-report) with the project's Python, which sees Debian's
python3-matplotlib. It reads only the run folder and writes only the output folder.
Partial runs are fine: every plot is drawn from whatever events exist, and a plot without data
says so instead of failing.
"""

import argparse
import bisect
import collections
import datetime
import html
import json
import math
import os
import re
import sys
import traceback

PROG = "scripts/report"


class ReportError(Exception):
    """Bad input: printed as one line, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        raise ReportError(message)


# --------------------------------------------------------------------------------------------
# Reading the run folder


def number(record, key):
    """record[key] as a finite float, or None when absent, null, non-numeric or not finite."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_jsonl(path):
    """The JSON objects of a metrics.jsonl file, and the count of lines that are not one (a
    process killed mid-write leaves a truncated last line)."""
    records, skipped = [], 0
    try:
        with open(path, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    skipped += 1
                    continue
                if isinstance(record, dict) and isinstance(record.get("event"), str):
                    records.append(record)
                else:
                    skipped += 1
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror}") from None
    return records, skipped


def natural_key(name):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class Process:
    """One process of the run: its folder name and metrics records."""

    def __init__(self, run_dir, name):
        self.name = name
        self.path = os.path.join(run_dir, name, "metrics.jsonl")
        self.present = os.path.isfile(self.path)
        self.records, self.skipped = read_jsonl(self.path) if self.present else ([], 0)

    def events(self, *names):
        return [r for r in self.records if r["event"] in names]

    def last(self, name):
        found = self.events(name)
        return found[-1] if found else None


class Run:
    def __init__(self, run_dir):
        if not os.path.exists(run_dir):
            raise ReportError(f"no such run folder: {run_dir}")
        if not os.path.isdir(run_dir):
            raise ReportError(f"not a run folder: {run_dir} is a file, not a folder")
        self.dir = run_dir
        try:
            names = sorted(os.listdir(run_dir), key=natural_key)
        except OSError as e:
            raise ReportError(f"cannot read the run folder {run_dir}: {e.strerror}") from None
        dirs = [n for n in names if os.path.isdir(os.path.join(run_dir, n))]
        self.learners = [Process(run_dir, n) for n in dirs if re.fullmatch(r"learner-.+", n)]
        self.mergers = [Process(run_dir, n) for n in dirs if re.fullmatch(r"merger-.+", n)]
        self.eval = Process(run_dir, "eval") if "eval" in dirs else None
        self.run_json, self.run_json_error = self._read_run_json()
        if not (self.learners or self.mergers or self.eval or self.run_json is not None):
            raise ReportError(
                f"{run_dir} is not a run folder: it has no learner-*/, merger-*/ or eval/ folder "
                "(scripts/run-local writes them, each with a metrics.jsonl)")
        self.logs = [n for n in names if n.endswith(".log") and os.path.isfile(os.path.join(run_dir, n))]
        self.config_text = self._read_text("config.toml")
        self.sample = self._read_text("sample.txt")
        model = os.path.join(run_dir, "final_model.safetensors")
        self.final_model_bytes = os.path.getsize(model) if os.path.isfile(model) else None

        times = [number(r, "time_us") for p in self.processes() for r in p.records]
        times = [t for t in times if t is not None]
        self.t0 = min(times) if times else None
        self.t_end = max(times) if times else None

    def processes(self):
        return self.learners + self.mergers + ([self.eval] if self.eval else [])

    def _read_text(self, name):
        path = os.path.join(self.dir, name)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, "rb") as f:
                return f.read().decode("utf-8", errors="replace")
        except OSError as e:
            raise ReportError(f"cannot read {path}: {e.strerror}") from None

    def _read_run_json(self):
        text = self._read_text("run.json")
        if text is None:
            return None, None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            return None, f"run.json is not valid JSON ({e})"
        if not isinstance(value, dict):
            return None, "run.json is not a JSON object"
        return value, None

    def seconds(self, time_us):
        return (time_us - self.t0) / 1e6

    def run_id(self):
        if self.run_json:
            for key in ("run_id", "id", "run"):
                if isinstance(self.run_json.get(key), str):
                    return self.run_json[key]
        for p in self.processes():
            start = p.last("start")
            source = start.get("config") if start else None
            if isinstance(source, str):
                m = re.search(r'run\.id="([^"]*)"', source)
                if m:
                    return m.group(1)
        return os.path.basename(os.path.normpath(self.dir))


# --------------------------------------------------------------------------------------------
# Deriving the numbers


def last_value(series):
    """The total of a cumulative() series, or None when no event recorded the counter."""
    return series[-1][1] if any(not is_start for _, _, is_start in series) else None


def kafka_traffic(processes):
    """(sent, received, note) over the Kafka sockets of the processes that counted them (runs of older
    binaries did not), or None when none did; note says how many did when not all of them."""
    counted = [p for p in processes if p.kafka_sent is not None and p.kafka_received is not None]
    if not counted:
        return None
    note = "" if len(counted) == len(processes) else f" ({len(counted)} of {len(processes)} recorded)"
    return sum(p.kafka_sent for p in counted), sum(p.kafka_received for p in counted), note


def cumulative(records, keys):
    """[(time_us, value, is_start)] of a counter that each process start resets to zero, made
    cumulative across restarts of the same learner (its metrics.jsonl is appended to). keys maps
    an event name to the field holding the counter in that event. A start event adds a point
    holding the total so far, with is_start set."""
    out, offset, last, restarted = [], 0.0, 0.0, False
    for r in records:
        t = number(r, "time_us")
        if r["event"] == "start":
            restarted = bool(out)
            if t is not None:
                out.append((t, last, True))
            continue
        key = keys.get(r["event"])
        v = number(r, key) if key else None
        if v is None or t is None:
            continue
        if restarted and offset + v < last:
            offset = last
        restarted = False
        last = offset + v
        out.append((t, last, False))
    return out


def interpolate(series, times, t):
    """The value of a growing cumulative() series (times: its time column) at time t: linear
    between points, 0 before the first, the last value after the end. From a start point the
    value stays flat up to the next point: a learner waits for the global state before its first
    step."""
    if not series or t < series[0][0]:
        return 0.0
    i = bisect.bisect_right(times, t) - 1
    if i == len(series) - 1:
        return series[-1][1]
    (t1, v1, hold), (t2, v2, _) = series[i], series[i + 1]
    return v1 if hold or t2 == t1 else v1 + (v2 - v1) * (t - t1) / (t2 - t1)


class LearnerStats:
    def __init__(self, p):
        self.name = p.name
        recs = p.records
        start = p.last("start") or {}
        self.region = start.get("region") if isinstance(start.get("region"), str) else "?"
        # Which program ran it: diloco-learner, or "python" (a decoupled_diloco.Session).
        self.client = start.get("client") if isinstance(start.get("client"), str) else None
        self.starts = len(p.events("start"))
        parameters = start.get("parameters")
        self.parameters = parameters if isinstance(parameters, int) and parameters > 0 else None
        self.tokens_series = cumulative(recs, {"step": "tokens", "eval": "tokens", "stop": "tokens"})
        self.tokens_times = [t for t, _, _ in self.tokens_series]
        self.tokens = self.tokens_series[-1][1] if self.tokens_series else 0.0
        steps = cumulative(recs, {"step": "step", "eval": "step", "stop": "step"})
        self.steps = steps[-1][1] if steps else 0.0
        # Step events with their restart-adjusted step number, for the training-loss plot.
        self.step_points = []
        step_by_time = {t: v for t, v, _ in cumulative(recs, {"step": "step"})}
        for r in p.events("step"):
            t = number(r, "time_us")
            if t in step_by_time:
                self.step_points.append((t, step_by_time[t], number(r, "loss"), number(r, "loss_ema"),
                                         number(r, "tokens_per_s")))
        self.evals = [(number(r, "time_us"), number(r, "eval_loss")) for r in p.events("eval")]
        self.evals = [(t, v) for t, v in self.evals if t is not None and v is not None]
        stops = p.events("stop")
        self.stop_reason = stops[-1].get("reason") if stops and isinstance(stops[-1].get("reason"), str) else None
        if self.starts > len(stops) and self.stop_reason:
            self.stop_reason += " (an earlier start has no stop)"
        self.deltas = [(number(r, "time_us"), number(r, "wire_bytes")) for r in p.events("delta")]
        self.deltas = [(t, b) for t, b in self.deltas if t is not None and b is not None]
        self.wire_bytes = sum(b for _, b in self.deltas)
        self.acked_series = cumulative(recs, {"step": "bytes_sent"})
        # The downlink: parameter bytes received from mergers (absent in runs of older binaries).
        received = cumulative(recs, {"step": "bytes_received", "shutdown": "bytes_received"})
        self.bytes_received = received[-1][1] if received else None
        # Every byte of the learner's Kafka sockets, protocol included (absent in older runs).
        self.kafka_sent = last_value(cumulative(recs, {"step": "kafka_sent", "shutdown": "kafka_sent"}))
        self.kafka_received = last_value(cumulative(recs, {"step": "kafka_received", "shutdown": "kafka_received"}))
        delivered = cumulative(recs, {"step": "deltas_delivered", "shutdown": "delivered"})
        self.delivered = delivered[-1][1] if delivered else None
        superseded = cumulative(recs, {"step": "deltas_superseded", "shutdown": "superseded"})
        self.superseded = superseded[-1][1] if superseded else None
        self.undelivered = sum(len(r["undelivered"]) for r in p.events("shutdown")
                               if isinstance(r.get("undelivered"), list))
        self.adopts = len(p.events("adopt"))
        last_step = p.last("step") or {}
        self.loss_ema = number(last_step, "loss_ema")
        self.tokens_per_s = number(last_step, "tokens_per_s")
        rss = [number(r, "max_rss_kb") for r in p.events("step")]
        rss = [v for v in rss if v is not None]
        self.max_rss_kb = max(rss) if rss else None


class MergerTraffic:
    def __init__(self, p):
        self.kafka_sent = last_value(cumulative(p.records, {"status": "kafka_sent", "stop": "kafka_sent"}))
        self.kafka_received = last_value(cumulative(p.records, {"status": "kafka_received", "stop": "kafka_received"}))


class MergeStats:
    def __init__(self, mergers):
        merges, self.duplicates = [], 0
        seen = set()
        for p in mergers:
            for r in p.events("merge"):
                fragment, version, t = number(r, "fragment"), number(r, "version"), number(r, "time_us")
                if fragment is None or version is None or t is None:
                    continue
                if (fragment, version) in seen:
                    self.duplicates += 1  # a fragment version logged twice: look at the merger logs
                    continue
                seen.add((fragment, version))
                merges.append((t, int(fragment), int(version), r))
        merges.sort(key=lambda m: m[0])
        self.merges = merges
        self.staleness, self.inputs_by_learner = [], collections.Counter()
        self.staleness_by_fragment = collections.defaultdict(list)
        self.dropped = collections.Counter()
        self.sync_seconds = []
        for _, fragment, _, r in merges:
            for i in r.get("inputs") if isinstance(r.get("inputs"), list) else []:
                if not isinstance(i, dict):
                    continue
                s = number(i, "staleness")
                if s is not None:
                    self.staleness.append(int(s))
                    self.staleness_by_fragment[fragment].append(int(s))
                self.inputs_by_learner[str(i.get("learner", "?"))] += 1
            for d in r.get("dropped") if isinstance(r.get("dropped"), list) else []:
                reason = d.get("reason") if isinstance(d, dict) else None
                self.dropped[reason if isinstance(reason, str) else "unknown"] += 1
            s = number(r, "sync_seconds")
            if s is not None:
                self.sync_seconds.append(s)
        # Deltas dropped after a fragment's last merge and deltas still pending when a merger
        # stopped are only counted in its stop record.
        self.held_at_stop = sum(int(number(r, "held") or 0) for p in mergers for r in p.events("stop_record"))
        self.rejected = collections.Counter(r["reason"] if isinstance(r.get("reason"), str) else "unknown"
                                            for p in mergers for r in p.events("rejected"))
        # Every learner that finds no version 0 proposes one and the first proposal of a fragment
        # wins: the others are rejected as genesis_exists, which is how a run starts, not a fault.
        self.later_proposals = self.rejected.pop("genesis_exists", 0)
        self.genesis = {}  # fragment -> the learner whose proposal is its version 0
        self.merge_failed = sum(len(p.events("merge_failed")) for p in mergers)
        self.fenced = sum(len(p.events("fenced")) for p in mergers)
        # Version of each fragment over time: version 0 committed from a learner's proposal, or a
        # recovery, gives the starting point, merges the steps.
        self.timeline = collections.defaultdict(list)
        for p in mergers:
            for r in p.events("genesis"):
                fragment, t = number(r, "fragment"), number(r, "time_us")
                if None not in (fragment, t):
                    self.timeline[int(fragment)].append((t, 0))
                    self.genesis[int(fragment)] = str(r.get("learner", "?"))
            for r in p.events("recovered"):
                fragment, version, t = number(r, "fragment"), number(r, "version"), number(r, "time_us")
                if None not in (fragment, version, t):
                    self.timeline[int(fragment)].append((t, int(version)))
        for t, fragment, version, _ in merges:
            self.timeline[fragment].append((t, version))
        for points in self.timeline.values():
            points.sort()
        self.final_versions = {f: max(v for _, v in pts) for f, pts in self.timeline.items()}
        self.merges_by_fragment = collections.Counter(f for _, f, _, _ in merges)


def global_evals(run):
    if not run.eval:
        return []
    out = []
    for r in run.eval.events("global_eval"):
        t, loss = number(r, "time_us"), number(r, "eval_loss")
        if t is not None and loss is not None:
            out.append((t, loss, number(r, "version_sum")))
    return out


# --------------------------------------------------------------------------------------------
# Formatting


def count(v):
    return "–" if v is None else f"{int(round(v)):,}"


def loss(v):
    return "–" if v is None else f"{v:.4f}"


def size(n):
    if n is None:
        return "–"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{int(n):,} B ({n / scale:.1f} {unit})"
    return f"{int(n):,} B"


def duration(seconds):
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min {s:02d} s" if hours else f"{minutes} min {s:02d} s"


def learner_text(s):
    """A learner as the headline names it: its region, and the client when it is not diloco-learner."""
    client = f", {s.client}" if s.client and s.client != "diloco-learner" else ""
    return f"{s.name} in {s.region}{client}"


def counter_text(counter):
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counter.items())) if counter else "none"


# --------------------------------------------------------------------------------------------
# Plots


class Plotter:
    def __init__(self, out_dir):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.out_dir = out_dir

    def figure(self, title, xlabel, ylabel):
        fig, ax = self.plt.subplots(figsize=(8, 4.5), dpi=100)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        return fig, ax

    def save(self, fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(self.out_dir, name))
        self.plt.close(fig)

    def empty(self, name, title, reason):
        fig, ax = self.plt.subplots(figsize=(8, 4.5), dpi=100)
        ax.set_title(title)
        ax.text(0.5, 0.5, f"no data: {reason}", ha="center", va="center", wrap=True, transform=ax.transAxes)
        ax.set_axis_off()
        self.save(fig, name)


def clock(run):
    """The x of a unix time in microseconds: seconds since the run's first event, or minutes for
    runs longer than half an hour; and the axis label."""
    span = run.seconds(run.t_end) if run.t0 is not None else 0
    scale, unit = (60.0, "minutes") if span > 1800 else (1.0, "seconds")
    return (lambda t: run.seconds(t) / scale), f"wall clock ({unit} since the run's first event)"


def plot_heldout(run, plotter, learners, evals, total_tokens):
    title = "Held-out loss"
    learner_evals = [(s.name, s.evals) for s in learners if s.evals]
    if not evals and not learner_evals:
        if run.eval is None:
            missing = "no eval/ folder"
        elif not run.eval.present:
            missing = "no eval/metrics.jsonl"
        else:
            missing = "no global_eval events in eval/metrics.jsonl"
        reason = missing + "; no eval events in learner-*/metrics.jsonl"
        plotter.empty("heldout_loss_tokens.png", title + " vs tokens", reason)
        plotter.empty("heldout_loss_time.png", title + " vs wall clock", reason)
        return

    def curves(ax, x_of):
        if evals:
            ax.plot([x_of(t) for t, _, _ in evals], [v for _, v, _ in evals], "o-", color="black",
                    linewidth=2, markersize=4, label="global model (eval-only learner)", zorder=3)
        for name, points in learner_evals:
            ax.plot([x_of(t) for t, _ in points], [v for _, v in points], "s--", markersize=3, alpha=0.8,
                    label=f"{name} (local model)")
        ax.legend(fontsize=8)

    fig, ax = plotter.figure(title + " vs tokens", "tokens trained by all learners at that time",
                             "held-out loss (nats/char)")
    if learners and any(s.tokens_series for s in learners):
        curves(ax, total_tokens)
        plotter.save(fig, "heldout_loss_tokens.png")
    else:
        plotter.plt.close(fig)
        plotter.empty("heldout_loss_tokens.png", title + " vs tokens", "no token counts in learner-*/metrics.jsonl")

    at, xlabel = clock(run)
    fig, ax = plotter.figure(title + " vs wall clock", xlabel, "held-out loss (nats/char)")
    curves(ax, at)
    plotter.save(fig, "heldout_loss_time.png")


def plot_wire_bytes(run, plotter, learners):
    name, title = "wire_bytes.png", "Bytes on the wire per learner (cumulative)"
    if not any(s.deltas or s.acked_series for s in learners):
        plotter.empty(name, title, "no delta or step events in learner-*/metrics.jsonl")
        return
    at, xlabel = clock(run)
    fig, ax = plotter.figure(title, xlabel, "MiB")
    for s in learners:
        if s.deltas:
            total, xs, ys = 0.0, [], []
            for t, b in s.deltas:
                total += b
                xs.append(t)
                ys.append(total / (1 << 20))
            line, = ax.step([at(t) for t in xs], ys, where="post", label=f"{s.name}: published deltas")
            color = line.get_color()
        else:
            color = None
        if s.acked_series:
            ax.step([at(t) for t, _, _ in s.acked_series], [v / (1 << 20) for _, v, _ in s.acked_series],
                    ":", where="post", color=color, label=f"{s.name}: acknowledged by Kafka")
    ax.legend(fontsize=8, ncol=2 if len(learners) > 3 else 1)
    plotter.save(fig, name)


def plot_staleness(plotter, merges):
    name, title = "staleness.png", "Staleness of merged deltas"
    if not merges.staleness and not merges.dropped and not merges.held_at_stop:
        plotter.empty(name, title, "no merge events in merger-*/metrics.jsonl")
        return
    fig, (ax, bx) = plotter.plt.subplots(1, 2, figsize=(10, 4.5), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    ax.set_title(title)
    ax.set_xlabel("staleness (global versions the delta's base is behind)")
    ax.set_ylabel("deltas merged")
    ax.grid(True, alpha=0.3)
    if merges.staleness:
        low, top = min(merges.staleness), max(merges.staleness)
        # One bar per staleness value, unless the values spread too far for that.
        bins = [b - 0.5 for b in range(low, top + 2)] if top - low <= 100 else 50
        ax.hist(merges.staleness, bins=bins, rwidth=0.85)
        if top - low < 20:
            ax.set_xticks(range(low, top + 1))
        mean = sum(merges.staleness) / len(merges.staleness)
        ax.axvline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.2f}")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no delta merged", ha="center", va="center", transform=ax.transAxes)
    reasons = dict(merges.dropped)
    if merges.held_at_stop:
        reasons["held at merger stop"] = merges.held_at_stop
    bx.set_title("Deltas not merged, by reason")
    if reasons:
        labels = sorted(reasons)
        bx.barh(labels, [reasons[k] for k in labels], color="tab:red")
        bx.set_xlabel("deltas")
        bx.grid(True, axis="x", alpha=0.3)
    else:
        bx.text(0.5, 0.5, "no delta dropped", ha="center", va="center", transform=bx.transAxes)
        bx.set_axis_off()
    plotter.save(fig, name)


def plot_versions(run, plotter, merges):
    name, title = "fragment_versions.png", "Global version of each fragment"
    if not merges.timeline:
        plotter.empty(name, title, "no merge, genesis or recovered events in merger-*/metrics.jsonl")
        return
    at, xlabel = clock(run)
    fig, ax = plotter.figure(title, xlabel, "version")
    for fragment in sorted(merges.timeline):
        points = merges.timeline[fragment]
        ax.step([at(t) for t, _ in points] + [at(run.t_end)], [v for _, v in points] + [points[-1][1]],
                where="post", label=f"fragment {fragment}")
    ax.legend(fontsize=8, ncol=2 if len(merges.timeline) > 6 else 1)
    plotter.save(fig, name)


def plot_training(run, plotter, learners):
    name, title = "training_loss.png", "Training loss per learner"
    if not any(s.step_points for s in learners):
        plotter.empty(name, title, "no step events in learner-*/metrics.jsonl")
    else:
        fig, ax = plotter.figure(title, "inner step", "training loss (nats/char)")
        for s in learners:
            pts = [(step, raw, ema) for _, step, raw, ema, _ in s.step_points]
            if not pts:
                continue
            line, = ax.plot([p[0] for p in pts if p[2] is not None], [p[2] for p in pts if p[2] is not None],
                            label=f"{s.name} (moving average)")
            ax.plot([p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None],
                    color=line.get_color(), alpha=0.25, linewidth=0.8)
        ax.legend(fontsize=8)
        plotter.save(fig, name)

    name, title = "tokens_per_s.png", "Training throughput per learner"
    if not any(p[4] is not None for s in learners for p in s.step_points):
        plotter.empty(name, title, "no step events in learner-*/metrics.jsonl")
        return
    at, xlabel = clock(run)
    fig, ax = plotter.figure(title, xlabel, "tokens/s (moving average)")
    for s in learners:
        pts = [(t, tps) for t, _, _, _, tps in s.step_points if tps is not None]
        if pts:
            ax.plot([at(t) for t, _ in pts], [v for _, v in pts], label=s.name)
    ax.legend(fontsize=8)
    plotter.save(fig, name)


def read_chaos(run_dir):
    """scripts/chaos's timeline (chaos.jsonl: one fault or repair per line) and result (chaos.json),
    or ([], None) for a run it did not make."""
    events, result = [], None
    try:
        with open(os.path.join(run_dir, "chaos.jsonl"), errors="replace") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and isinstance(e.get("time_us"), (int, float)) and isinstance(e.get("target"), str):
                    events.append(e)
    except OSError:
        return [], None
    try:
        with open(os.path.join(run_dir, "chaos.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        pass
    return events, result


def down_intervals(events, t_end):
    """target -> [(from_us, to_us, kind)] of each fault, from its kill or stop to its restart or cont."""
    out = collections.defaultdict(list)
    since = {}
    for e in events:
        target, action = e["target"], e.get("action")
        if action in ("kill", "stop", "term"):
            since[target] = (e["time_us"], e.get("kind", action))
        elif action in ("restart", "cont") and target in since:
            a, kind = since.pop(target)
            out[target].append((a, e["time_us"], kind))
    for target, (a, kind) in since.items():
        out[target].append((a, t_end, kind))
    return out


def plot_chaos(run, plotter, merges, events):
    name, title = "chaos_timeline.png", "Faults and merges"
    at, xlabel = clock(run)
    intervals = down_intervals(events, run.t_end)
    targets = sorted(intervals, key=natural_key)
    fig, ax = plotter.figure(title, xlabel, "")
    colours = {"kill": "tab:red", "pause": "tab:orange", "term": "tab:purple"}
    for i, target in enumerate(targets):
        for a, b, kind in intervals[target]:
            ax.broken_barh([(at(a), max(at(b) - at(a), 0.2))], (i - 0.35, 0.7), color=colours.get(kind, "tab:gray"))
    merge_times = sorted(t for points in merges.timeline.values() for t, v in points if v > 0)
    ax.plot([at(t) for t in merge_times], [len(targets)] * len(merge_times), "|", color="tab:blue", markersize=10)
    ax.set_yticks(range(len(targets) + 1), targets + ["merges"])
    ax.set_ylim(-0.8, len(targets) + 0.8)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colours["kill"], label="killed (kill -9) until restarted"),
                       Patch(color=colours["pause"], label="paused (SIGSTOP) until SIGCONT"),
                       Patch(color=colours["term"], label="stopped (SIGTERM) until restarted")], fontsize=8)
    plotter.save(fig, name)


# (file, title, caption) of every plot, in the order of the page.
PLOTS = [
    ("heldout_loss_tokens.png", "Held-out loss vs tokens",
     "Held-out loss of the global model (eval-only learner) and of each learner's local model against "
     "the tokens trained by all learners at that time."),
    ("heldout_loss_time.png", "Held-out loss vs wall clock",
     "The same against wall-clock time since the run's first event."),
    ("wire_bytes.png", "Bytes on the wire",
     "Cumulative bytes of the deltas each learner published (solid) and of those Kafka had acknowledged "
     "at each step event (dotted; deltas flushed at shutdown come after the last step event)."),
    ("staleness.png", "Staleness and dropped deltas",
     "Staleness of every merged delta, and the deltas that were not merged, by reason."),
    ("fragment_versions.png", "Versions per fragment",
     "Global version of each fragment over time (from the mergers' merge and recovery events)."),
    ("training_loss.png", "Training loss",
     "Training loss per learner against its inner step (moving average; raw loss faint)."),
    ("tokens_per_s.png", "Throughput", "Training throughput per learner over time."),
]


# --------------------------------------------------------------------------------------------
# The page: a list of blocks rendered once as Markdown and once as HTML


def build_page(run, out_dir, learners, merges, evals, total_tokens, notes):
    blocks = []
    run_id = run.run_id()
    blocks.append(("h1", f"Run {run_id}"))
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    try:
        started = datetime.datetime.fromtimestamp(run.t0 / 1e6).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    except (TypeError, ValueError, OverflowError, OSError):  # no events, or a time_us out of range
        started = "–"
    blocks.append(("p", f"Run folder `{os.path.abspath(run.dir)}`, first event at {started}; "
                        f"report written {generated}."))

    # Headline numbers.
    rows = []
    if evals:
        t, v, vsum = evals[-1]
        best = min(evals, key=lambda e: e[1])
        rows.append(("Final global held-out loss", f"{loss(v)} (at {run.seconds(t):.1f} s, "
                     f"{count(total_tokens(t))} tokens, version sum {count(vsum)})"))
        rows.append(("Best global held-out loss", f"{loss(best[1])} (at {run.seconds(best[0]):.1f} s, "
                     f"{count(total_tokens(best[0]))} tokens)"))
        rows.append(("Global evaluations", count(len(evals))))
    else:
        rows.append(("Final global held-out loss", "– (no global evaluation recorded)"))
    rows.append(("Tokens trained (all learners)", count(sum(s.tokens for s in learners))))
    rows.append(("Inner steps (all learners)", count(sum(s.steps for s in learners))))
    rows.append(("Wall time", duration(run.seconds(run.t_end) if run.t0 is not None else None)))
    rows.append(("Learners", f"{len(learners)}" + (f" ({', '.join(learner_text(s) for s in learners)})"
                                                   if learners else "")))
    rows.append(("Mergers", count(len(run.mergers))))
    rows.append(("Merges", count(len(merges.merges))))
    rows.append(("Deltas merged", count(sum(merges.inputs_by_learner.values()))))
    rows.append(("Deltas dropped by reason", counter_text(merges.dropped)))
    rows.append(("Deltas held when a merger stopped", count(merges.held_at_stop)))
    if merges.genesis:
        proposers = collections.defaultdict(list)
        for fragment, learner in sorted(merges.genesis.items()):
            proposers[learner].append(str(fragment))
        rows.append(("Version 0 proposed by", "; ".join(f"{learner} (fragments {', '.join(fragments)})"
                                                        for learner, fragments in proposers.items()) +
                     f"; {count(merges.later_proposals)} later proposal(s) not needed"))
    if merges.rejected:
        rows.append(("Messages rejected by reason", counter_text(merges.rejected)))
    total_wire = sum(s.wire_bytes for s in learners)
    n_deltas = sum(len(s.deltas) for s in learners)
    rows.append(("Bytes on the wire (published deltas, all learners)", size(total_wire)))
    for s in learners:
        rows.append((f"Bytes on the wire, {s.name}", size(s.wire_bytes)))
    received = [s.bytes_received for s in learners]
    rows.append(("Bytes received from mergers (parameters, all learners)",
                 size(sum(received)) if received and None not in received else "– (not recorded)"))
    # What fp32 data parallel would send for the same learner steps: every step, each learner sends
    # and receives its gradient (2 x 4 bytes per parameter).
    parameters = next((s.parameters for s in learners if s.parameters), None)
    all_steps = sum(s.steps for s in learners)
    data_parallel = 2 * 4 * parameters * all_steps if parameters and all_steps else None
    downlink = sum(received) if received and None not in received else None
    if data_parallel and downlink is not None and total_wire + downlink > 0:
        both = total_wire + downlink
        rows.append(("fp32 data parallel at the same steps (2 x 4 B x parameters per learner step)",
                     size(data_parallel)))
        rows.append(("Both directions against fp32 data parallel",
                     f"{size(both)}: {data_parallel / both:,.0f}x fewer bytes"))
    learner_kafka = kafka_traffic(learners)
    if learner_kafka:
        rows.append(("Kafka sockets of the learners (sent / received, protocol and heartbeats included)",
                     f"{size(learner_kafka[0])} / {size(learner_kafka[1])}{learner_kafka[2]}"))
        sockets = learner_kafka[0] + learner_kafka[1] + (downlink or 0)
        if data_parallel and downlink is not None and not learner_kafka[2] and sockets > 0:
            rows.append(("Learners' sockets, both directions (Kafka and parameters received), against fp32 data parallel",
                         f"{size(sockets)}: {data_parallel / sockets:,.0f}x fewer bytes"))
    merger_kafka = kafka_traffic([MergerTraffic(p) for p in run.mergers])
    if merger_kafka:
        rows.append(("Kafka sockets of the mergers (sent / received: records, checkpoints, deltas read)",
                     f"{size(merger_kafka[0])} / {size(merger_kafka[1])}{merger_kafka[2]}"))
    rows.append(("Deltas published", count(n_deltas)))
    rows.append(("Mean bytes per delta", size(total_wire / n_deltas) if n_deltas else "–"))
    if merges.staleness:
        rows.append(("Mean staleness of merged deltas", f"{sum(merges.staleness) / len(merges.staleness):.2f} "
                     f"(max {max(merges.staleness)})"))
    else:
        rows.append(("Mean staleness of merged deltas", "–"))
    if merges.final_versions:
        rows.append(("Versions per fragment", ", ".join(f"{f}: {v}" for f, v in sorted(merges.final_versions.items()))))
    else:
        rows.append(("Versions per fragment", "–"))
    if merges.sync_seconds:
        rows.append(("Mean merge sync time", f"{sum(merges.sync_seconds) / len(merges.sync_seconds):.3f} s"))
    blocks.append(("h2", "Headline"))
    blocks.append(("table", ["", "value"], rows))

    if notes:
        blocks.append(("h2", "Notes on the data"))
        blocks.append(("list", notes))

    # Learners.
    if learners:
        blocks.append(("h2", "Learners"))
        header = ["learner", "region", "steps", "tokens", "stop", "deltas published", "delivered",
                  "superseded", "undelivered", "merged", "wire bytes", "bytes/delta", "received", "adoptions",
                  "final loss (avg)", "last held-out", "tokens/s", "max RSS"]
        rows = []
        for s in learners:
            rows.append([s.name, s.region, count(s.steps), count(s.tokens), s.stop_reason or "no stop event",
                         count(len(s.deltas)), count(s.delivered), count(s.superseded), count(s.undelivered),
                         count(merges.inputs_by_learner.get(s.name, 0)),
                         size(s.wire_bytes), size(s.wire_bytes / len(s.deltas)) if s.deltas else "–",
                         size(s.bytes_received) if s.bytes_received is not None else "–",
                         count(s.adopts), loss(s.loss_ema), loss(s.evals[-1][1]) if s.evals else "–",
                         count(s.tokens_per_s),
                         f"{s.max_rss_kb / 1024:,.0f} MiB" if s.max_rss_kb is not None else "–"])
        blocks.append(("table", header, rows))

    if merges.merges or merges.timeline:
        blocks.append(("h2", "Fragments"))
        rows = []
        for f in sorted(merges.timeline):
            stale = merges.staleness_by_fragment.get(f, [])
            rows.append([str(f), count(merges.final_versions.get(f)), count(merges.merges_by_fragment.get(f, 0)),
                         count(len(stale)), f"{sum(stale) / len(stale):.2f}" if stale else "–"])
        blocks.append(("table", ["fragment", "final version", "merges", "deltas merged", "mean staleness"], rows))

    blocks.append(("h2", "Plots"))
    for name, title, caption in PLOTS:
        blocks.append(("image", name, title, caption))

    if run.sample is not None:
        blocks.append(("h2", "Sample from the final model"))
        blocks.append(("pre", run.sample))
    if run.final_model_bytes is not None:
        blocks.append(("p", f"Final model: `final_model.safetensors`, {size(run.final_model_bytes)}."))

    blocks.append(("h2", "Configuration"))
    sources = sorted({p.last("start").get("config") for p in run.learners + ([run.eval] if run.eval else [])
                      if p.last("start") and isinstance(p.last("start").get("config"), str)})
    if sources:
        blocks.append(("p", "Config as the processes report it: " + "; ".join(f"`{s}`" for s in sources)))
    if run.config_text is not None:
        blocks.append(("p", "`config.toml` of the run folder:"))
        blocks.append(("pre", run.config_text))
    elif sources:
        blocks.append(("p", "The run folder has no `config.toml`; the line above names the config file and "
                            "overrides."))
    else:
        blocks.append(("p", "The run folder has no `config.toml`, and no process logged its config."))
    if run.run_json is not None:
        blocks.append(("p", "`run.json`:"))
        blocks.append(("pre", json.dumps(run.run_json, indent=2, sort_keys=True)))

    files = [(p.name + "/metrics.jsonl", p) for p in run.processes() if p.present]
    if files or run.logs:
        blocks.append(("h2", "Files"))
        rel = os.path.relpath(run.dir, out_dir)
        items = [("link", os.path.join(rel, name), f"{name} ({len(p.records):,} events)") for name, p in files]
        items += [("link", os.path.join(rel, name), name) for name in run.logs]
        blocks.append(("list", items))
    return blocks


def chaos_blocks(events, result):
    """The section of a scripts/chaos run: what was broken, what it cost, and the checks."""
    blocks = [("h2", "Chaos")]
    kinds = collections.Counter((e["target"].split("-")[0], e.get("kind")) for e in events
                                if e.get("action") in ("kill", "stop", "term"))
    names = {"kill": "kills", "pause": "pauses", "term": "SIGTERM stops"}
    rows = [(f"{target} {names.get(kind, kind)}", count(n)) for (target, kind), n in sorted(kinds.items())]
    if result:
        gp = result.get("goodput")
        rows += [("Mode", str(result.get("mode"))), ("Seed", str(result.get("seed"))),
                 ("Goodput (merged learner compute / provisioned learner-seconds)",
                  f"{gp:.3f}" if isinstance(gp, (int, float)) else "–"),
                 ("Goodput of the learner-seconds the learners were up",
                  f"{result['goodput_of_available']:.3f}" if isinstance(result.get("goodput_of_available"), (int, float)) else "–"),
                 ("Longest stall (no new version of any fragment)", f"{result.get('longest_stall_seconds')} s"),
                 ("Longest stall while a merger lived", f"{result.get('longest_stall_while_a_merger_lives_seconds')} s"),
                 ("Median merge interval of a fragment", f"{result.get('fragment_merge_interval_seconds')} s"),
                 ("Checks", ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in (result.get("checks") or {}).items()))]
    blocks.append(("table", ["", "value"], rows))
    for p in (result or {}).get("problems", [])[:10]:
        blocks.append(("p", f"Problem: {p}"))
    blocks.append(("image", "chaos_timeline.png", "Faults and merges",
                   "Each fault from the kill or SIGSTOP to the restart or SIGCONT (chaos.jsonl), and every merge."))
    return blocks


def inline_html(text):
    """Escapes text; `code` spans become <code>."""
    parts = text.split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def md_cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks):
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            out.append(f"# {block[1]}\n")
        elif kind == "h2":
            out.append(f"## {block[1]}\n")
        elif kind == "p":
            out.append(block[1] + "\n")
        elif kind == "table":
            header, rows = block[1], block[2]
            out.append("| " + " | ".join(md_cell(h) for h in header) + " |")
            out.append("|" + "---|" * len(header))
            for row in rows:
                out.append("| " + " | ".join(md_cell(c) for c in row) + " |")
            out.append("")
        elif kind == "list":
            for item in block[1]:
                if isinstance(item, tuple):
                    out.append(f"- [{item[2]}]({item[1]})")
                else:
                    out.append(f"- {item}")
            out.append("")
        elif kind == "image":
            out.append(f"### {block[2]}\n")
            out.append(f"![{block[2]}]({block[1]})\n")
            out.append(f"{block[3]}\n")
        elif kind == "pre":
            fence = "````" if "```" in block[1] else "```"
            out.append(f"{fence}\n{block[1].rstrip()}\n{fence}\n")
    return "\n".join(out)


STYLE = """body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
img { max-width: 100%; border: 1px solid #eee; }
figure { margin: 1.5em 0; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; white-space: pre-wrap; }"""


def render_html(blocks, title):
    out = ["<!doctype html>", "<html lang=\"en\">", "<head>", "<meta charset=\"utf-8\">",
           f"<title>{html.escape(title)}</title>", f"<style>\n{STYLE}\n</style>", "</head>", "<body>"]
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2"):
            out.append(f"<{kind}>{inline_html(block[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{inline_html(block[1])}</p>")
        elif kind == "table":
            header, rows = block[1], block[2]
            out.append("<table>")
            out.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
            for row in rows:
                out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
            out.append("</table>")
        elif kind == "list":
            out.append("<ul>")
            for item in block[1]:
                if isinstance(item, tuple):
                    out.append(f"<li><a href=\"{html.escape(item[1])}\">{html.escape(item[2])}</a></li>")
                else:
                    out.append(f"<li>{inline_html(item)}</li>")
            out.append("</ul>")
        elif kind == "image":
            out.append(f"<h3>{html.escape(block[2])}</h3>")
            out.append(f"<figure><img src=\"{html.escape(block[1])}\" alt=\"{html.escape(block[2])}\">"
                       f"<figcaption>{html.escape(block[3])}</figcaption></figure>")
        elif kind == "pre":
            out.append(f"<pre>{html.escape(block[1])}</pre>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------


def data_notes(run, learners, merges, evals):
    """What is missing or odd in the run folder, in plain words."""
    notes = []
    for p in run.processes():
        rel = f"{p.name}/metrics.jsonl"
        if not p.present:
            notes.append(f"`{rel}` is missing.")
        elif not p.records:
            notes.append(f"`{rel}` has no events.")
        if p.skipped:
            notes.append(f"`{rel}`: skipped {p.skipped} line(s) that are not a JSON event "
                         "(a process killed while writing leaves a truncated last line).")
    if run.eval is None:
        notes.append("No `eval/` folder: the global model was not evaluated.")
    elif run.eval.present and not evals:
        notes.append("`eval/metrics.jsonl` has no global evaluation.")
    for s in learners:
        if s.starts > 1:
            notes.append(f"{s.name} started {s.starts} times; its counters are added up across the restarts.")
        if not s.stop_reason and s.starts:
            notes.append(f"{s.name} has no stop event: it was killed or was still running.")
    for p in run.mergers:
        if p.records and not p.events("merge"):
            notes.append(f"{p.name} never merged.")
    if merges.duplicates:
        notes.append(f"{merges.duplicates} merge event(s) repeat a fragment version already logged; counted once.")
    if merges.merge_failed:
        notes.append(f"{merges.merge_failed} merge(s) failed and were recovered (see the merger logs).")
    if merges.fenced:
        notes.append(f"{merges.fenced} merger instance(s) were fenced by a newer one.")
    if run.run_json_error:
        notes.append(run.run_json_error + "; ignored.")
    return notes


def report(run_dir, out_dir):
    run = Run(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "report")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ReportError(f"output path exists and is not a folder: {out_dir}")
    try:
        plotter = Plotter(out_dir)
    except ImportError as e:
        raise ReportError(f"matplotlib is not available to {sys.executable} ({e}): run scripts/bootstrap "
                          "or apt-get install -y python3-matplotlib") from None
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create the output folder {out_dir}: {e.strerror}") from None

    learners = [LearnerStats(p) for p in run.learners]
    merges = MergeStats(run.mergers)
    evals = global_evals(run)

    def total_tokens(t):
        return sum(interpolate(s.tokens_series, s.tokens_times, t) for s in learners)

    plot_heldout(run, plotter, learners, evals, total_tokens)
    plot_wire_bytes(run, plotter, learners)
    plot_staleness(plotter, merges)
    plot_versions(run, plotter, merges)
    plot_training(run, plotter, learners)
    chaos_events, chaos_result = read_chaos(run_dir)
    if chaos_events:
        plot_chaos(run, plotter, merges, chaos_events)

    notes = data_notes(run, learners, merges, evals)
    blocks = build_page(run, out_dir, learners, merges, evals, total_tokens, notes)
    if chaos_events:
        blocks[2:2] = chaos_blocks(chaos_events, chaos_result)
    title = f"Run {run.run_id()}"
    for name, text in (("index.md", render_markdown(blocks)), ("index.html", render_html(blocks, title))):
        path = os.path.join(out_dir, name)
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise ReportError(f"cannot write {path}: {e.strerror}") from None
    return os.path.join(out_dir, "index.html")


def main(argv=None) -> int:
    """scripts/report: writes the report of a run folder and prints the path of its index.html;
    the exit status (1 on bad input, with one line that says why)."""
    parser = ArgumentParser(
        prog=PROG,
        description="Plots and a summary page (index.md, index.html) of a run folder written by "
                    "scripts/run-local: held-out loss of the global model and of each learner against tokens "
                    "and wall clock, bytes on the wire per learner, staleness of merged deltas and dropped "
                    "deltas by reason, versions per fragment, training loss and throughput per learner.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder, e.g. runs/demo-20261130-080520")
    parser.add_argument("--out", metavar="DIR", help="where the report goes (default: RUN_DIR/report)")
    try:
        args = parser.parse_args(argv)
        index = report(args.run_dir, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line that names the place, not a traceback
        frame = traceback.extract_tb(e.__traceback__)[-1]
        print(f"error: the report failed on unexpected data ({type(e).__name__}: {e}, at "
              f"{os.path.basename(frame.filename)}:{frame.lineno})", file=sys.stderr)
        return 1
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
