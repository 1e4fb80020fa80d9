#!/usr/bin/env bash
# Instruction mix of every flash_forward_kernel in a binary (needs cuobjdump, on the GPU machine): matrix (HMMA),
# shared-memory matrix loads (LDSM), async copies (LDGSTS), exponentials (MUFU.EX2), barriers, local-memory
# traffic (LDL/STL: spills) and the total, per kernel. Usage: sass_summary.sh BINARY
set -uo pipefail
cuobjdump -sass "$1" | awk '
  /Function : / { if (name != "") report(); name = $3; n = 0; delete c; next }
  /^ *\/\*[0-9a-f]+\*\// && name != "" {
    n++
    for (k in pat) if ($0 ~ pat[k]) c[k]++
  }
  function report() {
    if (name ~ /flash_forward_kernel/) {
      printf "%s\n   total %d", name, n
      for (k in pat) printf "  %s %d", k, c[k] + 0
      printf "\n"
    }
  }
  BEGIN { pat["HMMA"] = "HMMA"; pat["LDSM"] = "LDSM"; pat["LDGSTS"] = "LDGSTS"; pat["MUFU.EX2"] = "MUFU.EX2";
          pat["BAR"] = "BAR.SYNC"; pat["LDL"] = "LDL"; pat["STL"] = "STL"; pat["SHFL"] = "SHFL" }
  END { if (name != "") report() }'
