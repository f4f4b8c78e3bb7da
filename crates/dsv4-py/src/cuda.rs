//! The CUDA backend, when this build links it (`cuda` feature).

use pyo3::PyResult;

/// Register the CUDA backend with core dispatch (created lazily on first use).
pub fn register() {
    #[cfg(feature = "cuda")]
    dsv4_cuda::register();
}

/// Make CUDA launches on `ordinal` use the caller's stream; false without a CUDA backend.
pub fn set_stream(ordinal: usize, stream: u64) -> PyResult<bool> {
    #[cfg(feature = "cuda")]
    {
        dsv4_cuda::runtime::set_current_stream(ordinal, Some(stream));
        Ok(true)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, stream);
        Ok(false)
    }
}
