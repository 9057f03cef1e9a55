"""SASS (sm_90) of every n=4 / tuned product launch, instruction text only, hashed per id."""
import hashlib, json, re, subprocess, sys, tempfile, os
from pathlib import Path
from tools.cutile import signatures as s
from tools.cutile.resources import find_cuobjdump
from mhc_core.kernels.cutile import toolchain
tc = toolchain.find_toolchain(); obj = find_cuobjdump(); env = tc.env(); env["PATH"] = f"{obj.parent}:{env['PATH']}"
plan = s.signature_plan(ns=(4,)) + s.tuned_plan()
only = sys.argv[2] if len(sys.argv) > 2 else ""
out = {}
for p in plan:
    if only not in p.id: continue
    with tempfile.TemporaryDirectory() as tmp:
        bc, cub = Path(tmp, "k.bc"), Path(tmp, "k.cubin")
        bc.write_bytes(s.export_bytecode(p))
        subprocess.run([str(tc.tileiras), str(bc), "-o", str(cub), "--gpu-name", "sm_90", "-O3"], env=env, check=True, capture_output=True)
        r = subprocess.run([str(obj), "-sass", str(cub)], env=env, capture_output=True, text=True)
        txt = r.stdout if r.returncode == 0 else ""
        res = subprocess.run([str(obj), "-res-usage", str(cub)], env=env, capture_output=True, text=True).stdout
        res = " ".join(re.findall(r"(?:REG|SHARED|LOCAL|STACK):\d+", res))
    ins = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", l).strip() for l in txt.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    out[p.id] = {"kernel": p.kernel_name, "n_ins": len(ins), "res": res, "sha": hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16],
                 "consts": [a.value for a in p.args if isinstance(a, s.ConstArg)]}
    print(p.id, out[p.id]["n_ins"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True)
print(len(out), "launches")
