#!/usr/bin/env bash
# Checks the deployment files against their schemas:
# - every Kubernetes manifest in k8s/ with kubernetes-validate --strict (unknown fields are
#   errors), against the Kubernetes OpenAPI schemas the package ships for each version;
# - the compose file with check-jsonschema and the compose-spec schema it ships
#   (vendor.compose-spec);
# - the KEDA ScaledObject, which has no schema there (a CRD), for the fields skein needs.
# Both tools come from PyPI, pinned, installed with pip into a cache directory once; they
# read only what they ship, so the checks run offline after that.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBERNETES_VALIDATE=1.37.0
CHECK_JSONSCHEMA=0.39.0
KUBERNETES=1.32.0

cache="${SKEIN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skein-tests}"
tools="$cache/deploy-validators-$KUBERNETES_VALIDATE-$CHECK_JSONSCHEMA"
if [ ! -x "$tools/bin/kubernetes-validate" ] || [ ! -x "$tools/bin/check-jsonschema" ]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "error: the deployment checks install kubernetes-validate and check-jsonschema from" >&2
    echo "       PyPI with pip, which is missing. Install it with: sudo apt-get install python3-pip" >&2
    exit 1
  fi
  echo "installing kubernetes-validate $KUBERNETES_VALIDATE and check-jsonschema $CHECK_JSONSCHEMA into $tools" >&2
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
    --no-warn-script-location --target "$tools" \
    "kubernetes-validate==$KUBERNETES_VALIDATE" "check-jsonschema==$CHECK_JSONSCHEMA" >&2
fi
run() { PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}" python3 "$tools/bin/$1" "${@:2}"; }

# Every manifest (nats-values.yaml holds Helm values, not a manifest).
manifests=()
for f in k8s/*.yaml; do
  [ "$f" = k8s/nats-values.yaml ] || manifests+=("$f")
done
run kubernetes-validate --strict --kubernetes-version "$KUBERNETES" "${manifests[@]}"
run check-jsonschema --builtin-schema vendor.compose-spec deploy/docker-compose.yml

PYTHONPATH="$tools" python3 - k8s/autoscaling.yaml <<'PY'
import sys, yaml
errors = []
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if not doc or doc.get("kind") != "ScaledObject":
        continue
    name = doc["metadata"]["name"]
    for t in doc["spec"].get("triggers", []):
        m = t.get("metadata", {})
        if t.get("type") != "nats-jetstream":
            errors.append(f"{name}: trigger type {t.get('type')!r}, expected nats-jetstream")
            continue
        for key in ["natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold"]:
            if not isinstance(m.get(key), str):
                errors.append(f"{name}: trigger metadata {key} missing or not a string")
        if m.get("stream") != "SKEIN_JOBS":
            errors.append(f"{name}: stream {m.get('stream')!r}, expected SKEIN_JOBS")
        if not str(m.get("consumer", "")).startswith("pool-"):
            errors.append(f"{name}: consumer {m.get('consumer')!r} is not a pool consumer (pool-NAME)")
        if not str(m.get("natsServerMonitoringEndpoint", "")).startswith("nats-headless."):
            errors.append(f"{name}: the monitoring endpoint must be the headless service")
if errors:
    sys.exit("\n".join(errors))
print(f"{sys.argv[1]}: ScaledObject triggers name the headless monitor, SKEIN_JOBS and a pool consumer")
PY
echo "deployment files: ok" >&2
