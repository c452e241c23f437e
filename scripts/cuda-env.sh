# Source this (`. scripts/cuda-env.sh`) before `cargo build --release --features cuda` on a machine
# without a GPU (a copy of the shared recipe `../shared/cuda/env.sh`, kept in the repo so that CI, which
# checks the CUDA build with clippy on a clean clone, needs nothing outside it). First time: installs a CUDA 13.0 toolkit from PyPI wheels (about 1.2 GB) into
# $STREAMBP_CUDA (default ~/.cache/streambp-cuda13), adds the unversioned library links, and builds a
# link-time stub of libcuda (the driver library, which no wheel ships). Then exports what candle's build
# scripts read. Version 13.0 matches the lent GPUs' driver (580, CUDA 13.0): newer nvcc emits PTX that
# driver cannot load.
_sbp_dir=${STREAMBP_CUDA:-$HOME/.cache/streambp-cuda13}
_sbp_root=$_sbp_dir/nvidia/cu13
if [ ! -x "$_sbp_root/bin/nvcc" ]; then
  python3 -m pip install -q --no-deps --target "$_sbp_dir" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 \
    nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 \
    nvidia-cuda-nvrtc==13.0.88 || return 1
fi
for _sbp_f in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcurand.so.10 libnvrtc.so.13; do
  [ -e "$_sbp_root/lib/${_sbp_f%%.so*}.so" ] || ln -s "$_sbp_f" "$_sbp_root/lib/${_sbp_f%%.so*}.so"
done
if [ ! -e "$_sbp_root/lib/stubs/libcuda.so" ]; then
  # Every driver entry point that cuda.h declares or that a fetched cudarc names; bodies never run: at run
  # time the soname libcuda.so.1 resolves to the real driver.
  mkdir -p "$_sbp_root/lib/stubs"
  { gcc -E -P -I"$_sbp_root/include" "$_sbp_root/include/cuda.h" | grep -oE '\bcu[A-Z][A-Za-z0-9_]* *\(' | tr -d ' ('
    # (no cudarc sources fetched yet is fine: cuda.h names the entry points too; `|| true` keeps a
    # caller's `set -e -o pipefail` from stopping here)
    { cat "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-*/src/driver/sys/mod.rs 2>/dev/null |
      grep -oE 'load::<_F>\("cu[A-Za-z0-9_]+"\)' | sed -E 's/.*"(.*)".*/\1/'; } || true
  } | sort -u | awk '{print "int " $1 "(void) { return 999; }"}' > "$_sbp_root/lib/stubs/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$_sbp_root/lib/stubs/libcuda.so" \
    "$_sbp_root/lib/stubs/libcuda_stub.c" || return 1
fi
export CUDA_ROOT=$_sbp_root CUDA_PATH=$_sbp_root CUDA_HOME=$_sbp_root
export PATH=$_sbp_root/bin:$PATH
export LIBRARY_PATH=$_sbp_root/lib:$_sbp_root/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}   # H100 / H200
unset _sbp_dir _sbp_root _sbp_f
