import hashlib, sys, collections, re, subprocess, tempfile
from pathlib import Path
import triton
from aotattn.compiler.jobs import Job, compile_job
from aotattn.spec import Config, Functional
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
for table, pad, cfg in [("flash.attn_fwd", False, dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, TMA=2)),
                        ("flash.attn_bwd_dkdv", False, dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, TMA=1)),
                        ("flash.attn_bwd_dq", False, dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3, TMA=1)),
                        ("flash.attn_fwd", True, dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, TMA=2)),
                        ("flash.attn_bwd_dkdv", True, dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, TMA=1)),
                        ("flash.attn_bwd_dq", True, dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3, TMA=1))]:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    f = dict(dtype="bf16", BLOCK_D=d, BLOCK_DV=d, PAD_HEAD=pad, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0)
    try:
        e, cubin = compile_job(Job("sm_90", table, Functional.of(f), Config.of(**cfg)))
    except Exception as exc:
        print(table, pad, "FAILED", str(exc)[:200]); continue
    with tempfile.NamedTemporaryFile(suffix=".cubin") as t:
        t.write(cubin); t.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", t.name], capture_output=True, text=True).stdout
    c = collections.Counter(m.group(1) for m in re.finditer(r"\b(LDG\S*|LDGSTS\S*|UTMALDG\S*|STG\S*)", sass))
    body = "\n".join(l for l in sass.splitlines() if "/*" in l)
    print(table, pad, hashlib.sha256(body.encode()).hexdigest()[:12], dict(c))
