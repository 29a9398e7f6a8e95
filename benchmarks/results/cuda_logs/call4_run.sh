#!/usr/bin/env bash
# GPU call 1 of this session (issue 50): the two checks cut last time (Figure 4, sharded vs replicated),
# then measurements that choose the fixes: the fused read's tiles, the key search's top-k, a bf16 profile.
export PYTHONUNBUFFERED=1
g=/tmp/gpu; mkdir -p $g
step() {  # name limit command...: runs under a time limit, logs to $g/name.log, packs $g into $OUT
  local name=$1 limit=$2; shift 2; local t=$SECONDS rc=0
  timeout -k 5 $limit "$@" > $g/$name.log 2>&1 || rc=$?
  echo "$name: rc=$rc in $((SECONDS - t)) s" | tee -a $g/all.log
  tar -czf $OUT/gpu_results4.tgz -C $g .
}
step setup 40 bash benchmarks/gpu_suite.sh setup $g
step figure4 130 python3 benchmarks/inference_speed.py --dtype bf16 --parts figure4 --layers 12 24 --dims 1024 --memories 0 1 --out $g/inference_speed_cuda_figure4.json
step shard 120 python3 benchmarks/sharded_values.py --device cuda --worlds 1 --values lazy_adam --n-keys 512 1024 --batch 32 --seq 256 --budget-gib 60 --out $g/sharded_values_cuda.json
step keysearch 30 python3 benchmarks/key_search_speed.py --device cuda --out $g/key_search_speed_cuda.json
step profile_bf16 25 python3 benchmarks/profile_memory_layer.py --device cuda --bf16 --out $g/profile_memory_layer_512_bf16_cuda.txt
step tiles 150 python3 benchmarks/value_read_tiles.py --out $g/value_read_tiles_cuda.json
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $g/nvidia_smi.csv 2>&1
tar -czf $OUT/gpu_results4.tgz -C $g .
