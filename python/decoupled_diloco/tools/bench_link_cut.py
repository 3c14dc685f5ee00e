"""What a cut link did to a run of scripts/wan-sim (`--cut REGION@START+SECONDS`): how the cut
region's learners trained on, what the others merged meanwhile, how late and how stale the cut
region's deltas arrived once the link was back, what the downlink carried (updates and snapshots),
and the invariant checks of the run.

    bench/link-cut RUN_DIR            # a table on stdout
    bench/link-cut RUN_DIR --json     # the same as one JSON object

Reads only the run folder: wan.jsonl (the link events), the learners' and mergers' metrics.jsonl,
the evaluator's, and wan-check.json. Standard library only.
"""

import argparse
import json
import os
import sys

from .run_local import read_jsonl


def events(run, name, kind=None):
    return [e for e in read_jsonl(os.path.join(run, name, "metrics.jsonl")) if kind is None or e.get("event") == kind]


def tokens_per_s(steps):
    if len(steps) < 2 or steps[-1]["time_us"] == steps[0]["time_us"]:
        return None
    return round((steps[-1]["tokens"] - steps[0]["tokens"]) / ((steps[-1]["time_us"] - steps[0]["time_us"]) / 1e6))


def analyse(run):
    links = read_jsonl(os.path.join(run, "wan.jsonl"))
    cut = next((e for e in links if e.get("event") == "cut"), None)
    back = next((e for e in links if e.get("event") == "restored"), None)
    if not cut or not back:
        sys.exit(f"bench/link-cut: no cut and restore in {run}/wan.jsonl (run scripts/wan-sim with --cut)")
    t_cut, t_back, region = cut["time_us"], back["time_us"], cut["region"]
    run_info = json.load(open(os.path.join(run, "run.json")))
    learners = sorted(d for d in os.listdir(run) if d.startswith("learner-") and os.path.isdir(os.path.join(run, d)))
    cut_learners = [n for n, r in (run_info.get("learner_regions") or {}).items() if r == region]
    mergers = sorted(d for d in os.listdir(run) if d.startswith("merger-") and os.path.isdir(os.path.join(run, d)))
    merges = sorted((e for m in mergers for e in events(run, m, "merge")), key=lambda e: e["time_us"])
    out = {"region": region, "cut_seconds": round((t_back - t_cut) / 1e6, 1), "learners": {}}
    for n in learners:
        steps = [e for e in events(run, n, "step") if "tokens" in e]
        shutdown = (events(run, n, "shutdown") or [{}])[-1]
        after = [e for e in merges if e["time_us"] > t_back for i in e["inputs"] if i["learner"] == n]
        first_late = next(((e, i) for e in after for i in e["inputs"] if i["learner"] == n), None)
        adopts = [e for e in events(run, n, "adopt") if e["time_us"] > t_back]
        out["learners"][n] = {
            "cut": n in cut_learners if "learner_regions" in run_info else None,  # older run.json: unknown
            "tokens_per_s_before": tokens_per_s([e for e in steps if e["time_us"] < t_cut]),
            "tokens_per_s_during": tokens_per_s([e for e in steps if t_cut <= e["time_us"] <= t_back]),
            "deltas_delivered": shutdown.get("delivered"),
            "deltas_superseded_before_sending": shutdown.get("superseded"),
            "deltas_undelivered_at_stop": len(shutdown.get("undelivered", []) or []),
            "bytes_received": shutdown.get("bytes_received"),
            "first_merge_after_restore_s": round((first_late[0]["time_us"] - t_back) / 1e6, 2) if first_late else None,
            "first_merge_after_restore_staleness": first_late[1]["staleness"] if first_late else None,
            "first_adopt_after_restore_s": round((adopts[0]["time_us"] - t_back) / 1e6, 2) if adopts else None,
            "staleness_after_restore": [
                {"from_s": lo, "to_s": lo + 10,
                 "mean": (lambda s: round(sum(s) / len(s), 1) if s else None)(
                     [i["staleness"] for e in merges if t_back + lo * 1e6 <= e["time_us"] < t_back + (lo + 10) * 1e6
                      for i in e["inputs"] if i["learner"] == n])}
                for lo in range(0, 40, 10)],
        }
    during = [e for e in merges if t_cut <= e["time_us"] <= t_back]
    out["merges_during_cut"] = len(during)
    out["merges_per_s_before"] = round(len([e for e in merges if e["time_us"] < t_cut]) /
                                       max(1e-9, (t_cut - merges[0]["time_us"]) / 1e6), 2) if merges else None
    out["merges_per_s_during"] = round(len(during) / max(1e-9, (t_back - t_cut) / 1e6), 2)
    status = [e for m in mergers for e in events(run, m, "status") if "metrics" in e]
    if status:
        metrics = status[-1]["metrics"]
        out["snapshot_requests"] = metrics.get("snapshot_requests_total")
        out["snapshots_published"] = metrics.get("snapshots_published_total")
        out["snapshot_bytes"] = metrics.get('params_bytes_published_total{kind="snapshot_to_one"}')
        out["update_bytes"] = metrics.get('params_bytes_published_total{kind="update"}')
    evals = [(e["time_us"], e["eval_loss"]) for e in events(run, "eval", "global_eval")]

    def loss_at(t):
        before = [loss for when, loss in evals if when <= t]
        return round(before[-1], 4) if before else None
    out["heldout"] = {"at_cut": loss_at(t_cut), "at_restore": loss_at(t_back), "restore_plus_20s": loss_at(t_back + 20e6),
                      "end": round(evals[-1][1], 4) if evals else None}
    check_path = os.path.join(run, "wan-check.json")
    out["checks"] = json.load(open(check_path)) if os.path.exists(check_path) else None
    return out


def main(argv=None) -> int:
    """bench/link-cut: prints what the cut did to the run folder; the exit status."""
    p = argparse.ArgumentParser(prog="bench/link-cut", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        sys.exit(f"bench/link-cut: {args.run_dir} is not a run folder")
    out = analyse(args.run_dir)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"link of {out['region']} cut for {out['cut_seconds']} s; merges/s before {out['merges_per_s_before']}, "
          f"during {out['merges_per_s_during']} ({out['merges_during_cut']} merges)")
    for n, l in out["learners"].items():
        print(f"{n}{' (cut)' if l['cut'] else ''}: tokens/s {l['tokens_per_s_before']} before, {l['tokens_per_s_during']} "
              f"during; deltas delivered {l['deltas_delivered']}, superseded before sending "
              f"{l['deltas_superseded_before_sending']}, undelivered at stop {l['deltas_undelivered_at_stop']}; "
              f"first merge after restore {l['first_merge_after_restore_s']} s (staleness "
              f"{l['first_merge_after_restore_staleness']}); staleness after restore by 10 s: "
              f"{[s['mean'] for s in l['staleness_after_restore']]}; bytes received {l['bytes_received']}")
    print(f"snapshots: {out.get('snapshot_requests')} asked, {out.get('snapshots_published')} sent, "
          f"{out.get('snapshot_bytes')} bytes; updates {out.get('update_bytes')} bytes")
    print(f"held-out loss: {out['heldout']}")
    print(f"checks: {json.dumps(out['checks'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
