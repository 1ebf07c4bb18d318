//! Which GPUs a build's CUDA code runs on.
//!
//! A CUDA build compiles for one architecture, `CUDA_COMPUTE_CAP` (`scripts/build-cuda.sh 90`):
//! - candle's kernels and ours are PTX, which the driver JIT-compiles for the GPU it runs on,
//!   provided the GPU is at least that architecture;
//! - candle-flash-attn's kernels and candle's GGUF matrix kernels (`fast_mmvq`, `fast_mmq`) are
//!   machine code (SASS) only, which runs on that architecture's major version alone (sm_80
//!   code on sm_80, sm_86 and sm_89, not on sm_90);
//! - from sm_90 on, candle's build (cudaforge) compiles for architecture-specific targets: `90`
//!   to `120` become `sm_90a` .. `sm_120a`, whose PTX and code run on that exact architecture
//!   only, and later ones family targets (`sm_121f`: that major version, from that minor on).
//!
//! So a build for 90 runs on H100/H200 and nowhere else, and a build for 80 runs on A100 and,
//! through the PTX, partly on H100/H200 (not flash attention, not GGUF matrix kernels).

/// `CUDA_COMPUTE_CAP` as the CUDA build saw it. `None` without the `cuda` feature, or when it
/// was unset: candle then asked the build machine's `nvidia-smi`, and no one knows the answer
/// here.
pub const BUILD_COMPUTE_CAP: Option<&str> = option_env!("KEYDIFF_BUILD_COMPUTE_CAP");

/// The CUDA toolkit release the build's GPU code was compiled with (`13.0`), from `nvcc
/// --version`; `None` without the `cuda` feature.
pub const BUILD_CUDA_VERSION: Option<&str> = option_env!("KEYDIFF_BUILD_CUDA_VERSION");

/// The PTX ISA version of keydiff's kernels (`9.0`), from the `.version` line of the PTX this
/// build embeds (nvvm writes it, and a driver older than it cannot load the PTX); `None`
/// without the `cuda` feature.
pub fn ptx_isa() -> Option<&'static str> {
    #[cfg(feature = "cuda")]
    return crate::PTX
        .lines()
        .find_map(|l| l.trim().strip_prefix(".version "))
        .map(str::trim);
    #[cfg(not(feature = "cuda"))]
    None
}

/// The oldest architecture the pinned toolkit (CUDA 13) compiles for.
pub const OLDEST_ARCH: u32 = 75;
/// The oldest architecture FlashAttention-2 runs on.
pub const FLASH_OLDEST_ARCH: u32 = 80;

/// A build target: `80`, `86`, `90a`, `121f`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    /// major · 10 + minor.
    pub base: u32,
    /// What runs it besides machine code of its major version and later PTX.
    pub kind: ArchKind,
}

/// cudaforge's suffixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchKind {
    /// No suffix (below 90): its PTX runs on `base` and later.
    Portable,
    /// `a`: code and PTX run on `base` alone.
    Specific,
    /// `f`: code and PTX run on `base` and later GPUs of its major version.
    Family,
}

impl Arch {
    /// Parses `CUDA_COMPUTE_CAP` as cudaforge does: `90`, `9`, `90a`, `sm_90a`, `121f`; without a
    /// suffix, 90 to 120 become `a` and later ones `f`. (A dotted `9.0` is read as 90 too,
    /// though candle's build refuses it.)
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim().to_ascii_lowercase();
        let s = s.strip_prefix("sm_").unwrap_or(&s).replace('.', "");
        let (digits, suffix) = match s.char_indices().last() {
            Some((i, c @ ('a' | 'f'))) => (&s[..i], Some(c)),
            _ => (s.as_str(), None),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let base: u32 = digits.parse().ok()?;
        let base = if base < 20 { base * 10 } else { base };
        let kind = match suffix {
            Some('a') => ArchKind::Specific,
            Some(_) => ArchKind::Family,
            None if base > 120 => ArchKind::Family,
            None if base >= 90 => ArchKind::Specific,
            None => ArchKind::Portable,
        };
        (base > 0).then_some(Self { base, kind })
    }

    /// The build's target, when it is known ([`BUILD_COMPUTE_CAP`]).
    pub fn of_build() -> Option<Self> {
        BUILD_COMPUTE_CAP.and_then(Self::parse)
    }

    /// `sm_90a`, `sm_80`.
    pub fn name(self) -> String {
        let suffix = match self.kind {
            ArchKind::Portable => "",
            ArchKind::Specific => "a",
            ArchKind::Family => "f",
        };
        format!("sm_{}{suffix}", self.base)
    }

    /// How much of a build for `self` runs on a GPU of compute capability `major.minor`.
    pub fn fit(self, major: u32, minor: u32) -> Fit {
        let dev = major * 10 + minor;
        let same_major = major == self.base / 10;
        match self.kind {
            _ if dev < self.base => Fit::None,
            ArchKind::Specific if dev != self.base => Fit::None,
            ArchKind::Family if !same_major => Fit::None,
            ArchKind::Portable if !same_major => Fit::PtxOnly,
            _ => Fit::All,
        }
    }

    /// The GPUs a build for `self` runs all of its code on: `sm_90 GPUs alone`, `sm_8x GPUs
    /// from sm_80`.
    pub fn runs_on(self) -> String {
        let major = self.base / 10;
        match self.kind {
            ArchKind::Specific => format!("sm_{} GPUs alone", self.base),
            _ => format!("sm_{major}x GPUs from sm_{}", self.base),
        }
    }
}

/// A CUDA device's compute capability (major, minor) and name, as its driver reports them;
/// `None` on the CPU, in a build without the `cuda` feature, or when the driver does not say.
pub fn device_capability(dev: &candle_core::Device) -> Option<((u32, u32), String)> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = dev {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        let (major, minor) = ctx.compute_capability().ok()?;
        let name = ctx.name().unwrap_or_else(|_| "a GPU".into());
        return Some((
            (u32::try_from(major).ok()?, u32::try_from(minor).ok()?),
            name,
        ));
    }
    let _ = dev;
    None
}

/// How much of this build runs on `dev` ([`Arch::fit`]), with the build's target and the
/// device's capability and name: `None` on the CPU, or when the build's target
/// ([`BUILD_COMPUTE_CAP`]) or the device's capability is unknown.
pub fn device_fit(dev: &candle_core::Device) -> Option<DeviceFit> {
    let arch = Arch::of_build()?;
    let ((major, minor), name) = device_capability(dev)?;
    Some(DeviceFit {
        fit: arch.fit(major, minor),
        arch,
        capability: (major, minor),
        name,
    })
}

/// [`device_fit`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFit {
    pub fit: Fit,
    /// The build's target.
    pub arch: Arch,
    /// The device's compute capability.
    pub capability: (u32, u32),
    /// The device's name.
    pub name: String,
}

impl DeviceFit {
    /// `this GPU (NVIDIA H200) is sm_90, and this keydiff was built for sm_80
    /// (CUDA_COMPUTE_CAP=80)`.
    pub fn describe(&self) -> String {
        let (major, minor) = self.capability;
        let env = BUILD_COMPUTE_CAP.map_or(String::new(), |c| format!(" (CUDA_COMPUTE_CAP={c})"));
        format!(
            "this GPU ({}) is sm_{major}{minor}, and this keydiff was built for {}{env}",
            self.name,
            self.arch.name(),
        )
    }

    /// What to do about it: the build to make for this device (with `--flash` when `flash`),
    /// or why there is none.
    pub fn remedy(&self, flash: bool) -> String {
        let (major, minor) = self.capability;
        let dev = major * 10 + minor;
        if dev < OLDEST_ARCH {
            return format!(
                "CUDA 13, which keydiff builds with, compiles for sm_{OLDEST_ARCH} and later, so \
                 keydiff does not run on this GPU"
            );
        }
        if flash && dev < FLASH_OLDEST_ARCH {
            return format!(
                "flash attention runs on sm_{FLASH_OLDEST_ARCH} and later; use --attention eager"
            );
        }
        let flash = if flash { " --flash" } else { "" };
        format!("build one for this GPU with `scripts/build-cuda.sh {dev}{flash}`")
    }
}

/// How much of a build runs on a GPU ([`Arch::fit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Everything.
    All,
    /// The PTX kernels (candle's and keydiff's), not the machine-code ones: flash attention and
    /// candle's GGUF matrix kernels.
    PtxOnly,
    /// Nothing.
    None,
}

impl Fit {
    /// `all`, `ptx only`, `none`.
    pub fn name(self) -> &'static str {
        match self {
            Fit::All => "all",
            Fit::PtxOnly => "ptx only",
            Fit::None => "none",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_as_cudaforge_reads_them() {
        use ArchKind::*;
        let a = |base, kind| Some(Arch { base, kind });
        assert_eq!(Arch::parse("80"), a(80, Portable));
        assert_eq!(Arch::parse(" 8.6 "), a(86, Portable));
        assert_eq!(Arch::parse("9"), a(90, Specific));
        assert_eq!(Arch::parse("90"), a(90, Specific));
        assert_eq!(Arch::parse("SM_90A"), a(90, Specific));
        assert_eq!(Arch::parse("75a"), a(75, Specific));
        assert_eq!(Arch::parse("120"), a(120, Specific));
        assert_eq!(Arch::parse("121"), a(121, Family));
        assert_eq!(Arch::parse("100f"), a(100, Family));
        for bad in ["", "a", "sm_", "nine", "90b", "-80", "0"] {
            assert_eq!(Arch::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Arch::parse("90").unwrap().name(), "sm_90a");
        assert_eq!(Arch::parse("80").unwrap().name(), "sm_80");
        assert_eq!(Arch::parse("121").unwrap().name(), "sm_121f");
    }

    #[test]
    fn what_runs_where() {
        let fit = |arch: &str, major, minor| Arch::parse(arch).unwrap().fit(major, minor);
        assert_eq!(fit("80", 8, 0), Fit::All);
        assert_eq!(fit("80", 8, 6), Fit::All);
        assert_eq!(fit("80", 8, 9), Fit::All);
        assert_eq!(fit("80", 9, 0), Fit::PtxOnly);
        assert_eq!(fit("80", 12, 0), Fit::PtxOnly);
        assert_eq!(fit("80", 7, 5), Fit::None);
        assert_eq!(fit("86", 8, 0), Fit::None);
        assert_eq!(fit("86", 8, 9), Fit::All);
        assert_eq!(fit("90", 9, 0), Fit::All);
        assert_eq!(fit("90", 8, 0), Fit::None);
        assert_eq!(fit("90", 10, 0), Fit::None);
        assert_eq!(fit("100f", 10, 3), Fit::All);
        assert_eq!(fit("100f", 12, 0), Fit::None);
        assert_eq!(
            Arch::parse("80").unwrap().runs_on(),
            "sm_8x GPUs from sm_80"
        );
        assert_eq!(Arch::parse("90").unwrap().runs_on(), "sm_90 GPUs alone");
        assert_eq!(
            Arch::parse("121").unwrap().runs_on(),
            "sm_12x GPUs from sm_121"
        );
    }

    #[test]
    fn a_misfit_names_both_architectures_and_the_build_to_make() {
        let f = DeviceFit {
            fit: Fit::None,
            arch: Arch::parse("90").unwrap(),
            capability: (8, 0),
            name: "NVIDIA A100-SXM4-80GB".into(),
        };
        assert!(
            f.describe().starts_with(
                "this GPU (NVIDIA A100-SXM4-80GB) is sm_80, and this keydiff was built for sm_90a"
            ),
            "{}",
            f.describe()
        );
        assert_eq!(
            f.remedy(false),
            "build one for this GPU with `scripts/build-cuda.sh 80`"
        );
        assert_eq!(
            f.remedy(true),
            "build one for this GPU with `scripts/build-cuda.sh 80 --flash`"
        );
        let t4 = DeviceFit {
            capability: (7, 5),
            ..f.clone()
        };
        assert!(t4.remedy(false).contains("scripts/build-cuda.sh 75"));
        assert!(t4
            .remedy(true)
            .starts_with("flash attention runs on sm_80 and later"));
        let v100 = DeviceFit {
            capability: (7, 0),
            ..f
        };
        assert!(v100
            .remedy(false)
            .ends_with("keydiff does not run on this GPU"));
        assert_eq!(
            [Fit::All, Fit::PtxOnly, Fit::None].map(Fit::name),
            ["all", "ptx only", "none"]
        );
    }
}
