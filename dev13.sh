export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 560 python -m bench.fwd_tiles 4194304x64,2097152x128,1048576x256,262144x512 --kernels pallas,triton --out $OUT/ft 2>&1 | grep -v -i warn | tail -12
