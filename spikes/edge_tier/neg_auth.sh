#!/bin/bash
# Edge tier with TLS + SuperNode auth: registered key activates, unregistered key is refused.
set -u
V=/work/main/.venv/bin; D=/work/spike/runs/negauth-$(date +%H%M%S); mkdir -p $D/h/link $D/h/cli $D/h/n1 $D/h/n2
export PATH=/work/main/.venv/bin:$PATH FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
$V/python -c "import sys; sys.path.insert(0,'/work/main'); from fedhier.engines.deployment.certs import generate_certificates as g; g('$D/c', num_supernodes=2)"
C=$D/c
FLWR_HOME=$D/h/link setsid $V/flower-superlink --host 127.0.0.1 --port 9610 --isolation process --disable-runtime-dependency-installation \
  --ssl-certfile $C/server.crt --ssl-keyfile $C/server.key --ssl-ca-certfile $C/ca.crt --enable-supernode-auth > $D/link.log 2>&1 &
L=$!; sleep 6
printf '[superlink]\ndefault = "e"\n\n[superlink.e]\naddress = "127.0.0.1:9610"\nroot-certificates = "%s/ca.crt"\n' $C > $D/h/cli/config.toml
FLWR_HOME=$D/h/cli $V/flwr supernode register $C/supernode-0.pub e > $D/reg.log 2>&1; echo "register supernode-0 rc=$?"
for i in 0 1; do
  FLWR_HOME=$D/h/n$((i+1)) timeout 40 $V/flower-supernode --superlink 127.0.0.1:9610 --host 127.0.0.1 --port $((9611+i)) \
    --root-certificates $C/ca.crt --auth-supernode-private-key $C/supernode-$i --max-retries 2 > $D/n$i.log 2>&1 &
done
sleep 25
for i in 0 1; do echo "supernode-$i:"; grep -hoE "SuperNode ID[^\x1b]*|Failed to activate[^\x1b]*|No SuperNode found[^\x1b]*" $D/n$i.log | head -2; done
grep -hoE "No SuperNode found[^\x1b]*|Activated node_id[^\x1b]*" $D/link.log | sort | uniq -c
kill $L; wait 2>/dev/null; echo done
