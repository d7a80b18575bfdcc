#!/bin/bash
# before/after bench compare, alternating
cd /tmp  # before = a worktree at 83db0c5 (/work/wt-base), after = /work/main
for i in 2 3 4; do
  for side in before after; do
    if [ $side = before ]; then export PYTHONPATH=/work/wt-base TORCH_EXTENSIONS_DIR=/tmp/ext-base; else export PYTHONPATH=/work/main TORCH_EXTENSIONS_DIR=/tmp/ext-main; fi
    /work/main/.venv/bin/python -m sluiceway.cli bench compare --num-prompts 100 --sharegpt-max-output-len 64 --ignore-eos --save-result /tmp/bench/$side-$i.json > /tmp/bench/$side-$i.log 2>&1
    echo "$side $i done $(date +%T)"
  done
done
