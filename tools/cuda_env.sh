# Sourced by the GPU scripts (gpu_check.sh, h200_session.sh): finds CUDA_HOME and puts the
# folders holding libnvrtc / libcublas (toolkit or pip wheels) on LD_LIBRARY_PATH.
if [ -z "${CUDA_HOME:-}" ]; then
    for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13 /opt/cuda; do
        if [ -d "$d/include" ]; then export CUDA_HOME="$d"; break; fi
    done
fi
libdirs=()
[ -n "${CUDA_HOME:-}" ] && libdirs+=("$CUDA_HOME/lib64" "$CUDA_HOME/lib")
# pip wheels (nvidia-cuda-nvrtc, nvidia-cublas: nvidia/cu13/lib, or nvidia/<name>/lib)
while IFS= read -r d; do libdirs+=("$d"); done < <(python3 - 2>/dev/null <<'EOF'
import glob, os, site
roots = set(site.getsitepackages() + [site.getusersitepackages()])
for r in sorted(roots):
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
EOF
)
have_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }
for lib in libnvrtc.so.13 libcublas.so.13; do
    if ! have_lib "$lib"; then
        for d in "${libdirs[@]}"; do
            if [ -e "$d/$lib" ]; then
                case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
                break
            fi
        done
    fi
done
