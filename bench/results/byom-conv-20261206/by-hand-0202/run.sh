#!/usr/bin/env bash
# The acceptance scenario by hand: two Python conv learners (regions eu, us; 1000 steps each) with one
# C++ merger and a Python --eval-only evaluator on configs/tiny.toml, then one standalone conv
# learner of 1000 steps as the baseline. Broker: 127.0.0.1:29592.
set -euo pipefail
cd /work/main
B=127.0.0.1:29592 OUT=/tmp/diloco-acceptance-conv RID=accconv$(date +%s)
echo "$RID" >"$OUT/run_id"
SETS=(--set "run.id=\"$RID\"" --set train.total_steps=1000)
PY=.venv/bin/python
set -x
$PY -c "import decoupled_diloco._core as c; c.create_topics('$B', '$RID', ['eu', 'us'], 4)"
build/bin/diloco-merger -c configs/tiny.toml "${SETS[@]}" --id merger-0 --bootstrap $B --run-dir $OUT/merger-0 \
  >$OUT/merger-0.log 2>&1 &
M=$!
$PY examples/pytorch/train.py -c configs/tiny.toml --model conv "${SETS[@]}" --set train.eval_every=0 --id eu-0 \
  --region eu --regions eu,us --index 0 --learners 2 --steps 1000 --bootstrap $B --run-dir $OUT/eu-0 >$OUT/eu-0.log 2>&1 &
L0=$!
$PY examples/pytorch/train.py -c configs/tiny.toml --model conv "${SETS[@]}" --set train.eval_every=0 --id us-0 \
  --region us --regions eu,us --index 1 --learners 2 --steps 1000 --bootstrap $B --run-dir $OUT/us-0 >$OUT/us-0.log 2>&1 &
L1=$!
$PY examples/pytorch/train.py -c configs/tiny.toml --model conv --eval-only "${SETS[@]}" --id eval --region eu \
  --regions eu,us --eval-interval 5 --bootstrap $B --run-dir $OUT/eval --export $OUT/final_model.safetensors \
  >$OUT/eval.log 2>&1 &
E=$!
wait $L0 $L1
sleep 10  # the merger merges the learners' last deltas; the evaluator measures the last versions at its stop
kill -TERM $E; wait $E
kill -TERM $M; wait $M || true
$PY examples/pytorch/train.py -c configs/tiny.toml --model conv --standalone --set train.total_steps=1000 --steps 1000 \
  --eval-every 100 --id standalone --run-dir $OUT/standalone >$OUT/standalone.log 2>&1
