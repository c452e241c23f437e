//! The CPU a figure comes from, as the bench writes it beside its tables: `/proc/cpuinfo`'s model
//! name, the instruction-set flags that decide which kernels run (gemm's and ours), the cache
//! sizes gemm blocks its products for, the path our own passes run on (`STREAMBP_SIMD`) and the
//! bf16 products' kernel (`STREAMBP_BF16_KERNEL`). Machines with the same model name differ in
//! these (a virtual "AMD EPYC" may be a Zen 3, a Zen 4 or a Zen 5), so the name carries the
//! family and model numbers too: a Zen 4 and a Zen 5 have the same flags of these, and differ in
//! speed and in the bf16 kernel they take.

/// Flags that change which code runs: vector width, FMA, and bf16 arithmetic.
const KERNEL_FLAGS: [&str; 11] = [
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
];

/// This machine's CPU.
pub struct Cpu {
    /// `model name` of the first processor.
    pub model: String,
    /// Its `cpu family` and `model` numbers, where `/proc/cpuinfo` gives them.
    pub family_model: Option<(String, String)>,
    /// Which of [`KERNEL_FLAGS`] it has, in that order.
    pub flags: Vec<&'static str>,
}

impl Cpu {
    /// Read from `/proc/cpuinfo` (`unknown CPU` and no flags where it cannot be read).
    pub fn this() -> Self {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        Self::parse(&info)
    }

    fn parse(info: &str) -> Self {
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let have = field("flags").unwrap_or_default();
        let have: Vec<&str> = have.split_whitespace().collect();
        Self {
            model: field("model name").unwrap_or_else(|| "unknown CPU".into()),
            family_model: field("cpu family").zip(field("model")),
            flags: KERNEL_FLAGS
                .into_iter()
                .filter(|f| have.contains(f))
                .collect(),
        }
    }

    /// The model name with the family and model numbers (`AMD EPYC, family 26 model 2`): what
    /// tells two CPUs apart in the docs' tables.
    pub fn name(&self) -> String {
        match &self.family_model {
            Some((family, model)) => format!("{}, family {family} model {model}", self.model),
            None => self.model.clone(),
        }
    }

    /// Whether it computes in bf16 natively (AVX512-BF16 or AMX), where the bf16 goals apply.
    pub fn has_bf16_arithmetic(&self) -> bool {
        self.flags
            .iter()
            .any(|f| matches!(*f, "avx512_bf16" | "amx_bf16"))
    }
}

impl std::fmt::Display for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cache = *gemm_common::cache::CACHE_INFO;
        write!(
            f,
            "{} ({}; L2 {} KiB, L3 {} KiB as gemm reads them; {} cores, {} worker threads; our passes \
             on {}, bf16 products on the {} kernel)",
            self.name(),
            self.flags.join(" "),
            cache[1].cache_bytes >> 10,
            cache[2].cache_bytes >> 10,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            rayon::current_num_threads(),
            streambp_kernels::choices::in_force().simd.name(),
            streambp_kernels::choices::in_force().bf16_kernel.label(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_and_kernel_flags_from_cpuinfo() {
        let info = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\
                    flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 sha_ni\n\nprocessor\t: 1\n\
                    model name\t: AMD EPYC\n";
        let cpu = Cpu::parse(info);
        assert_eq!(cpu.model, "AMD EPYC");
        assert_eq!(cpu.name(), "AMD EPYC, family 26 model 2");
        assert_eq!(cpu.flags, ["avx2", "fma", "avx512f", "avx512_bf16"]);
        assert!(cpu.has_bf16_arithmetic());
        let none = Cpu::parse("");
        assert_eq!(none.name(), "unknown CPU");
        assert!(none.flags.is_empty() && !none.has_bf16_arithmetic());
    }
}
