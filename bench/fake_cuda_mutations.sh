#!/usr/bin/env bash
# Mutations the fake-CUDA test tier (tests/test_fake_cuda.py) must catch: each is applied, the tier runs, the
# file is restored. Every line should end in a failure.   bash bench/fake_cuda_mutations.sh
set -u
cd "$(dirname "$0")/.."
run() { # file python-replace-old python-replace-new label
  cp "$1" /tmp/mut_backup
  python3 -c "
import sys; p,o,n=sys.argv[1:4]; s=open(p).read(); assert o in s, 'pattern missing'; open(p,'w').write(s.replace(o,n,1))" "$1" "$2" "$3" || { echo "MUTATION $4: pattern missing"; return; }
  res=$(timeout 600 .venv/bin/python -m pytest -q -x -p no:warnings tests/test_fake_cuda.py -k "not choice_table" 2>&1 \
        | grep -m1 "^FAILED" || echo "NOT CAUGHT")
  cp /tmp/mut_backup "$1"
  echo "MUTATION $4 -> $res"
}
run tokenring/kernels.py 'cudnn_attention(qt, kt, vt, None' 'cudnn_attention(qt, vt, kt, None' "swap k,v in cudnn forward"
run tokenring/kernels.py 'dot, qt, kt, vt, ot, lse, seed, seed, None' 'ot, qt, kt, vt, dot, lse, seed, seed, None' "swap dO,O in cudnn backward"
run tokenring/kernels.py '        lse = lse.squeeze(-1)
' '        pass
' "cudnn lse used as (B,H,S)"
run tokenring/comm.py '    out.flat = torch.empty(total, dtype=torch.uint8, device=device)' '    out.flat = torch.empty(total, dtype=torch.uint8, device="cpu")' "CPU receive buffer"
run tokenring/comm.py '                    buf = pack(tensors)
' '                    buf = pack(tensors).to("cpu") if tensors[0].device.type == "meta" else pack(tensors)
' "CPU send buffer"
run tokenring/merge.py '    acc_lse.copy_(new_lse)' '    acc_lse.copy_(new_lse)
    if float(new_lse.max()) > 1e30:
        pass' "host sync per merge"
run tokenring/kernels.py '    ot, dot = o.contiguous().transpose(1, 2), dout.contiguous().transpose(1, 2)' '    ot, dot = o.transpose(1, 2), dout.transpose(1, 2)' "dO in another layout than O"
