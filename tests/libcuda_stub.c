/* A stand-in libcuda.so.1 for importing SGLang on a host without an NVIDIA driver (tests only).
 *
 * sglang-kernel's common_ops (sgl_kernel/sm90 and sm100, sglang 0.5.23) lists libcuda.so.1 as NEEDED
 * and imports one driver symbol, cuPointerGetAttribute, so SGLang's CPU engine cannot even be
 * imported without a driver. This stub satisfies the loader; the call answers
 * CUDA_ERROR_STUB_LIBRARY (34), as NVIDIA's own toolkit stub does. `make setup` builds it into
 * .venv-sglang/stub/ and tests/test_sglang.py puts that directory on LD_LIBRARY_PATH. */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data; (void)attribute; (void)ptr;
    return 34;
}
