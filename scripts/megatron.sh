# Sourced by scripts/test.sh (after env.sh): the two megatron-core releases te_paged is tested
# against, each in its own folder of the virtual environment, imported by path.
#
#   $VENV/megatron/0.19.2   the current release; the default (a .pth file puts it on sys.path)
#   $VENV/megatron/0.16.1   the earlier one; a test selects it with PYTHONPATH
#
# megatron-core 0.19.2 declares Python >= 3.12. Its Python files run on 3.11 (the datasets
# helper, its one compiled file, is not used by te_paged), so for the tests its wheel is
# installed for 3.12 into a folder, without pip's interpreter check. Users on Python 3.12
# install it with the line docs/megatron.md gives (`pip install --no-deps megatron-core==...`).
# Their dependencies without torch: numpy, packaging, psutil, and triton, which 0.19.2 imports
# without declaring it (a CUDA torch brings it, a CPU torch does not; te_paged's
# integrations/megatron/releases.py table).
# The releases' folders are their own (--target, --no-deps): they install beside the
# dependencies, each in a pip of its own.
release_pips=()
for spec in 0.19.2:3.12 0.16.1:3.11; do  # release:the Python its wheel is taken for
  release=${spec%%:*}
  target="$VENV/megatron/$release"
  [ -f "$target/megatron/core/package_info.py" ] && continue
  rm -rf "$target"
  "${pip_install[@]}" --no-deps --only-binary=:all: \
    --python-version "${spec##*:}" --ignore-requires-python --target "$target" \
    "megatron-core==$release" &
  release_pips+=($!)
done
"${pip_install[@]}" numpy packaging psutil triton
for pid in "${release_pips[@]}"; do
  wait "$pid" || { echo "megatron.sh: installing a megatron-core release failed" >&2; exit 1; }
done
# A megatron-core in site-packages itself (an older set-up installed 0.16.1 there) would shadow
# the .pth entry, which comes after site-packages on sys.path. (Not `pip show`: it also finds
# the releases' own folders through the .pth file, and pip would uninstall from there.)
if compgen -G "$SITE/megatron_core-*.dist-info" >/dev/null; then
  "$PY" -m pip uninstall -q -y megatron-core
fi
echo "$(cd "$VENV/megatron/0.19.2" && pwd)" >"$SITE/te_paged_test_megatron.pth"
export TE_PAGED_TEST_MEGATRON_ROOT="$(cd "$VENV/megatron" && pwd)"
