"""The global model's held-out loss over time (the evaluator's global_eval events) against the
standalone learner's at the same step (its eval events, interpolated), and the final numbers."""
import json, os
OUT = os.path.dirname(os.path.abspath(__file__))
def events(name, kind):
    return [e for e in map(json.loads, open(f"{OUT}/{name}/metrics.jsonl")) if e.get("event") == kind]
def interp(xs, ys, x):
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return None
learners = {n: events(n, "step") for n in ("eu-0", "us-0")}
start = min(events(n, "start")[0]["time_us"] for n in learners)
def step_at(n, t):
    s = [(start, 0)] + [(e["time_us"], e["step"]) for e in learners[n]]
    return interp([a for a, _ in s], [b for _, b in s], t) if t <= s[-1][0] else s[-1][1]
alone = [(e["step"], e["eval_loss"]) for e in events("standalone", "eval")]
print(f"{'seconds':>7} {'eu-0 step':>9} {'us-0 step':>9} {'versions':>16} {'global':>7} {'standalone at mean step':>24}")
rows = []
for e in events("eval", "global_eval"):
    t = (e["time_us"] - start) / 1e6
    steps = [step_at(n, e["time_us"]) for n in learners]
    mean = sum(steps) / 2
    ref = interp([a for a, _ in alone], [b for _, b in alone], mean)
    rows.append(dict(seconds=round(t, 1), steps=[round(s) for s in steps], versions=e["versions"], global_loss=e["eval_loss"], standalone_at_mean_step=ref))
    print(f"{t:7.1f} {steps[0]:9.0f} {steps[1]:9.0f} {str(e['versions']):>16} {e['eval_loss']:7.4f} {'-' if ref is None else f'{ref:.4f}':>24}")
print("standalone evals:", ", ".join(f"{s}: {l:.4f}" for s, l in alone))
merges = events("merger-0", "merge")
inputs = [len(m["inputs"]) for m in merges]
shut = {n: events(n, "shutdown")[-1] for n in learners}
final = rows[-1]["global_loss"]
print(f"final global {final:.4f} vs standalone at step 1000 {alone[-1][1]:.4f}: {100 * (final / alone[-1][1] - 1):+.2f} %")
print(f"merges {len(merges)}, inputs per merge {sum(inputs) / len(inputs):.2f} ({inputs.count(1)} of 1, {inputs.count(2)} of 2); "
      + "; ".join(f"{n}: {s['delivered']} deltas, {s['bytes_sent'] / 1e6:.2f} MB up, {s['bytes_received'] / 1e6:.2f} MB down" for n, s in shut.items()))
walls = {n: (learners[n][-1]["time_us"] - start) / 1e6 for n in learners}
print("learners' wall to step 1000 (s):", walls)
json.dump(dict(curve=rows, standalone=alone, final_global=final, final_standalone=alone[-1][1]), open(f"{OUT}/summary.json", "w"), indent=1)
