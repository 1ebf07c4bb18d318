//! Devices: parsing `--device`, opening CUDA devices with a clear refusal, listing what the
//! driver sees (`keydiff devices`), and hints for CUDA failures a user can fix.

use candle_core::Device;

use crate::arch::{self, Arch, Fit};
use crate::error::{EngineError, Result};

/// Parses `cpu`, `cuda`, `cuda:N` into a device, opening a CUDA device. A device that cannot
/// be used is refused with what is wrong: a build without the `cuda` feature, an ordinal past
/// the devices the driver sees (it names them), or the driver's own error.
pub fn parse_device(s: &str) -> Result<Device> {
    let ordinal = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        s if s.starts_with("cuda:") => s[5..]
            .parse()
            .map_err(|_| EngineError::BadParams(format!("bad device `{s}` (expected cuda:N)")))?,
        other => {
            return Err(EngineError::BadParams(format!(
                "unknown device `{other}` (expected cpu, cuda, cuda:N)"
            )))
        }
    };
    open_cuda(s, ordinal)
}

#[cfg(feature = "cuda")]
fn open_cuda(name: &str, ordinal: usize) -> Result<Device> {
    let refuse = |reason: String| EngineError::Device {
        name: name.to_string(),
        reason,
    };
    let count = device_count().map_err(refuse)?;
    if ordinal >= count {
        return Err(refuse(match count {
            0 => "the CUDA driver sees no device (see nvidia-smi, and CUDA_VISIBLE_DEVICES)".into(),
            1 => "this machine has 1 CUDA device, cuda:0".into(),
            n => format!(
                "this machine has {n} CUDA devices, cuda:0 to cuda:{}",
                n - 1
            ),
        }));
    }
    let device = Device::new_cuda(ordinal).map_err(|e| {
        let e = keydiff_cache::without_backtrace(e);
        refuse(format!("cannot open it: {e}"))
    })?;
    // Speed only: a device whose allocator cannot be set runs with the driver's settings.
    if let Err(e) = keydiff_model::memory::prepare_cuda(&device) {
        tracing::warn!("{name}: cannot set up its allocator ({e}); the driver's defaults stay");
    }
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(name: &str, _ordinal: usize) -> Result<Device> {
    Err(EngineError::Device {
        name: name.to_string(),
        reason: WITHOUT_CUDA.into(),
    })
}

/// What to do about a CUDA failure, from the text of its error (the driver names the cause:
/// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, ...): for the causes a user can fix. `None` for other
/// errors. `keydiff` prints it under the error.
pub fn cuda_error_hint(error: &str) -> Option<String> {
    if error.contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION") {
        let built = match (arch::BUILD_CUDA_VERSION, arch::ptx_isa()) {
            (Some(v), Some(isa)) => format!(" (CUDA {v}, PTX ISA {isa})"),
            (Some(v), None) => format!(" (CUDA {v})"),
            (None, Some(isa)) => format!(" (PTX ISA {isa})"),
            (None, None) => String::new(),
        };
        return Some(format!(
            "the NVIDIA driver is older than the CUDA toolkit this keydiff's GPU code was built \
             with{built}: update the driver (nvidia-smi shows the newest CUDA it supports), or \
             build keydiff with a toolkit it supports"
        ));
    }
    if error.contains("CUDA_ERROR_NO_BINARY_FOR_GPU")
        || error.contains("no kernel image is available")
    {
        let target = Arch::of_build().map_or("an unrecorded architecture".into(), |a| {
            format!("{} ({})", a.name(), a.runs_on())
        });
        return Some(format!(
            "a kernel of this keydiff could not be loaded for this GPU. Either the build \
             targets another architecture, {target}: build it for this GPU's compute capability \
             (nvidia-smi --query-gpu=compute_cap --format=csv; `scripts/build-cuda.sh 80` for an \
             A100); or the driver's PTX compiler (libnvidia-ptxjitcompiler.so.1) is missing, as in \
             containers given only part of the driver"
        ));
    }
    if error.contains("CUDA_ERROR_OUT_OF_MEMORY") {
        return Some(
            "the GPU ran out of memory beyond what keydiff planned (another process, or \
             candle's temporaries): a smaller --budget or --ctx-size, a quantized cache \
             (--kv-dtype q8_0), or a --memory-limit below the free memory, which requests are \
             then planned within"
                .into(),
        );
    }
    None
}

/// The driver's error in words, with what to check for the usual causes.
#[cfg(feature = "cuda")]
fn driver_said(e: &candle_core::cuda_backend::cudarc::driver::DriverError) -> String {
    use candle_core::cuda_backend::cudarc::driver::sys::CUresult;
    // A stub or broken driver may not describe its own error.
    let text = e
        .error_string()
        .map_or(String::new(), |s| format!(": {}", s.to_string_lossy()));
    let hint = match e.0 {
        CUresult::CUDA_ERROR_NO_DEVICE => {
            " (is a GPU there? see nvidia-smi, and CUDA_VISIBLE_DEVICES)"
        }
        CUresult::CUDA_ERROR_STUB_LIBRARY => {
            " (the libcuda.so.1 found is CUDA's link stub: no NVIDIA driver is installed, or the \
             stub comes first on LD_LIBRARY_PATH)"
        }
        _ => "",
    };
    format!("the CUDA driver says {:?}{text}{hint}", e.0)
}

/// How many CUDA devices the driver sees, or why it does not answer.
#[cfg(feature = "cuda")]
fn device_count() -> std::result::Result<usize, String> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let n = CudaContext::device_count().map_err(|e| driver_said(&e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// One CUDA device as the driver reports it ([`cuda_devices`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// `cuda:N`'s N.
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (u32, u32),
    /// Device memory, bytes.
    pub total_bytes: u64,
    /// How much of this build runs on it (`None`: the build's target was not recorded).
    pub fit: Option<Fit>,
}

/// The CUDA devices the driver sees, each with what it reports or why it could not be read;
/// `Err` when there are none to list: a build without CUDA, or a driver that does not answer.
/// Asked of the driver's device queries alone: no context is made on any GPU (which would
/// take memory on GPUs other jobs use, and fail on one held in exclusive mode), so free
/// memory is not known here (`nvidia-smi` shows it; `keydiff info` plans against it).
pub fn cuda_devices(
) -> std::result::Result<Vec<std::result::Result<CudaDeviceInfo, String>>, String> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::{result::device, sys::CUdevice_attribute};
        let arch = Arch::of_build();
        let one = |i: usize| -> std::result::Result<CudaDeviceInfo, String> {
            let said = |e| driver_said(&e);
            let dev = device::get(i as i32).map_err(said)?;
            // SAFETY: `dev` is a device the driver returned for this ordinal.
            let (major, minor, total) = unsafe {
                (
                    device::get_attribute(
                        dev,
                        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    )
                    .map_err(said)?,
                    device::get_attribute(
                        dev,
                        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    )
                    .map_err(said)?,
                    device::total_mem(dev).map_err(said)?,
                )
            };
            let (major, minor) = (major.max(0) as u32, minor.max(0) as u32);
            Ok(CudaDeviceInfo {
                ordinal: i,
                name: device::get_name(dev).unwrap_or_else(|_| "a GPU".into()),
                capability: (major, minor),
                total_bytes: total as u64,
                fit: arch.map(|a| a.fit(major, minor)),
            })
        };
        Ok((0..device_count()?).map(one).collect())
    }
    #[cfg(not(feature = "cuda"))]
    Err(WITHOUT_CUDA.into())
}

/// Why a build without the `cuda` feature has no CUDA devices.
#[cfg(not(feature = "cuda"))]
const WITHOUT_CUDA: &str = "this keydiff was built without CUDA; build it with `--features cuda` \
                            (scripts/build-cuda.sh builds one without a GPU)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_failures_a_user_can_fix_get_a_hint() {
        let ptx =
            "loading weights: DriverError(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, \"the provided \
                   PTX was compiled with an unsupported toolchain.\")";
        let h = cuda_error_hint(ptx).expect("a hint for an old driver");
        assert!(
            h.starts_with("the NVIDIA driver is older than the CUDA toolkit"),
            "{h}"
        );
        let h = cuda_error_hint("CUDA_ERROR_NO_BINARY_FOR_GPU").expect("a hint for the arch");
        let target = Arch::of_build().map_or("an unrecorded architecture".into(), |a| {
            format!("targets another architecture, {}", a.name())
        });
        assert!(h.contains(&target), "{h}");
        assert!(h.contains("libnvidia-ptxjitcompiler.so.1"), "{h}");
        let h = cuda_error_hint("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
            .expect("a hint for memory");
        assert!(h.contains("--memory-limit"), "{h}");
        for other in [
            "the prompt is empty",
            "DriverError(CUDA_ERROR_UNKNOWN, \"\")",
            "",
        ] {
            assert_eq!(cuda_error_hint(other), None, "{other}");
        }
    }
}
