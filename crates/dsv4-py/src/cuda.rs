//! The CUDA backend, when this build links it (`cuda` feature): registration, the caller's
//! stream, and the caller's allocator for the memory a call needs.

use pyo3::prelude::*;

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

#[cfg(feature = "cuda")]
mod alloc {
    use std::sync::{Arc, Mutex};

    use dsv4_cuda::runtime::{ForeignMemory, WorkspaceAllocator};
    use pyo3::prelude::*;

    /// A Python callable `(nbytes, device_ordinal) -> (data_ptr, owner)`: `dsv4_kernels`
    /// passes one that returns a torch uint8 tensor from torch's caching allocator on the
    /// current stream, so workspaces are stream-ordered, counted in torch's memory
    /// statistics and taken from a CUDA graph's private pool while one is captured.
    pub struct PyAllocator(pub Py<PyAny>);

    impl WorkspaceAllocator for PyAllocator {
        fn allocate(&self, ordinal: usize, bytes: usize) -> Result<ForeignMemory, String> {
            Python::with_gil(|py| {
                let got = self.0.call1(py, (bytes, ordinal)).map_err(|e| e.to_string())?;
                let (ptr, owner): (u64, Py<PyAny>) = got.extract(py).map_err(|e| format!("the workspace allocator returned {}: {e}", got.bind(py)))?;
                if ptr == 0 {
                    return Err(format!("the workspace allocator returned a null pointer for {bytes} bytes"));
                }
                Ok((ptr, Box::new(owner) as Box<dyn std::any::Any + Send + Sync>))
            })
        }
    }

    pub static CURRENT: Mutex<Option<Arc<dyn WorkspaceAllocator>>> = Mutex::new(None);
}

/// Set (or clear, with None) the allocator every CUDA call of this module takes its
/// device memory from (see `alloc::PyAllocator`). Returns whether a CUDA backend is linked.
#[pyfunction]
#[pyo3(signature = (allocator))]
pub fn set_workspace_allocator(allocator: Option<Py<PyAny>>) -> bool {
    #[cfg(feature = "cuda")]
    {
        let a = allocator.map(|f| std::sync::Arc::new(alloc::PyAllocator(f)) as std::sync::Arc<dyn dsv4_cuda::runtime::WorkspaceAllocator>);
        *alloc::CURRENT.lock().unwrap_or_else(|p| p.into_inner()) = a;
        true
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = allocator;
        false
    }
}

/// Run `f` for backend `be`. CUDA (and `auto`) calls keep the GIL and, where one is set, take their
/// device memory from the caller's allocator on this thread: their host work is tens of
/// microseconds of queueing, and each workspace callback would otherwise take the GIL back
/// (behind any Python thread that got it meanwhile, up to the interpreter's switch
/// interval). The reference computes on the host with the GIL released (`dsv4_kernels`
/// resolves `auto` before the call: host tensors reach this as `reference`).
pub fn compute<T: Send>(py: Python<'_>, be: dsv4_core::BackendName, f: impl FnOnce() -> T + Send) -> T {
    #[cfg(feature = "cuda")]
    {
        if be != dsv4_core::BackendName::Reference {
            let a = alloc::CURRENT.lock().unwrap_or_else(|p| p.into_inner()).clone();
            return match a {
                Some(a) => dsv4_cuda::runtime::with_workspace_allocator(a, f),
                None => f(),
            };
        }
        py.allow_threads(f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = be;
        py.allow_threads(f)
    }
}
