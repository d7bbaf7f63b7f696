//! How the engine copies: threads and thresholds, with defaults and environment overrides.

use crate::Error;

/// How a [`LocalCopyEngine`](crate::LocalCopyEngine) runs its copies.
///
/// Every field has a documented default; set the ones you need in a struct literal over
/// [`default`](Self::default) (or [`from_env`](Self::from_env)):
///
/// ```
/// use umbp_localcopy::LocalCopyConfig;
///
/// let config = LocalCopyConfig { threads: 4, parallel_threshold: 4 << 20, ..LocalCopyConfig::default() };
/// assert_eq!(config.threads, 4);
/// assert_eq!(config.non_temporal_threshold, 2048); // a default
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalCopyConfig {
    /// Threads that copy one large submit, the submitting thread included: the engine starts
    /// `threads - 1` workers. Default 2. The engine clamps it to
    /// `1 ..= std::thread::available_parallelism()`. Environment:
    /// [`THREADS_ENV`](Self::THREADS_ENV).
    pub threads: usize,
    /// Submits that move fewer bytes than this (or hold fewer than two pieces of work) run on
    /// the calling thread alone: waking a worker costs more than it saves. Default 1 MiB.
    /// Environment: [`PARALLEL_BYTES_ENV`](Self::PARALLEL_BYTES_ENV).
    pub parallel_threshold: usize,
    /// Segments of at least this many bytes are copied with non-temporal (cache-bypassing)
    /// stores, which keep a large transfer from evicting the caller's working set and save
    /// the read-for-ownership of each destination line. Default 2 KiB. Environment:
    /// [`NON_TEMPORAL_BYTES_ENV`](Self::NON_TEMPORAL_BYTES_ENV).
    pub non_temporal_threshold: usize,
    /// Whether to use non-temporal stores at all. They are used only where the CPU has them
    /// (SSE2 on x86_64, detected at run time); elsewhere every copy is a plain
    /// `copy_nonoverlapping`. Default `true`. Environment:
    /// [`NON_TEMPORAL_ENV`](Self::NON_TEMPORAL_ENV).
    pub non_temporal: bool,
}

impl Default for LocalCopyConfig {
    fn default() -> Self {
        Self {
            threads: 2,
            parallel_threshold: 1 << 20,
            non_temporal_threshold: 2 << 10,
            non_temporal: true,
        }
    }
}

impl LocalCopyConfig {
    /// Overrides [`threads`](Self::threads): a positive integer.
    pub const THREADS_ENV: &'static str = "UMBP_LOCALCOPY_THREADS";
    /// Overrides [`parallel_threshold`](Self::parallel_threshold): bytes, as an integer with an
    /// optional unit (`4096`, `64KiB` = 65,536, `64KB` = `64K` = 64,000, `1MiB`, `1GiB`).
    pub const PARALLEL_BYTES_ENV: &'static str = "UMBP_LOCALCOPY_PARALLEL_BYTES";
    /// Overrides [`non_temporal_threshold`](Self::non_temporal_threshold): bytes, as for
    /// [`PARALLEL_BYTES_ENV`](Self::PARALLEL_BYTES_ENV).
    pub const NON_TEMPORAL_BYTES_ENV: &'static str = "UMBP_LOCALCOPY_NT_BYTES";
    /// Overrides [`non_temporal`](Self::non_temporal): `1`, `true`, `on` or `0`, `false`, `off`.
    pub const NON_TEMPORAL_ENV: &'static str = "UMBP_LOCALCOPY_NON_TEMPORAL";

    /// The defaults, overridden by every variable of the environment that is set (see the
    /// `*_ENV` constants). A variable that is set but cannot be read as its field's value is an
    /// [`Error::InvalidEnv`]; nothing is silently ignored.
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The defaults, overridden by what `lookup` returns for each variable name.
    fn from_lookup(lookup: impl Fn(&'static str) -> Option<String>) -> Result<Self, Error> {
        let mut config = Self::default();
        let invalid =
            |var: &'static str, value: &str| Error::InvalidEnv { var, value: value.into() };
        if let Some(value) = lookup(Self::THREADS_ENV) {
            config.threads = match value.trim().parse() {
                Ok(n) if n > 0 => n,
                _ => return Err(invalid(Self::THREADS_ENV, &value)),
            };
        }
        if let Some(value) = lookup(Self::PARALLEL_BYTES_ENV) {
            config.parallel_threshold =
                parse_bytes(&value).ok_or_else(|| invalid(Self::PARALLEL_BYTES_ENV, &value))?;
        }
        if let Some(value) = lookup(Self::NON_TEMPORAL_BYTES_ENV) {
            config.non_temporal_threshold =
                parse_bytes(&value).ok_or_else(|| invalid(Self::NON_TEMPORAL_BYTES_ENV, &value))?;
        }
        if let Some(value) = lookup(Self::NON_TEMPORAL_ENV) {
            config.non_temporal = match value.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" => true,
                "0" | "false" | "off" | "no" => false,
                _ => return Err(invalid(Self::NON_TEMPORAL_ENV, &value)),
            };
        }
        Ok(config)
    }
}

/// A byte count, read by the `parse-size` crate as everywhere in umbp: `4096`, `64KiB`
/// (65,536), `64KB` or `64K` (64,000), `1MiB`, `1MB`; any case.
fn parse_bytes(value: &str) -> Option<usize> {
    parse_size::parse_size(value.trim()).ok().and_then(|bytes| usize::try_from(bytes).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&'static str, &str)]) -> Result<LocalCopyConfig, Error> {
        LocalCopyConfig::from_lookup(|name| {
            vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn unset_variables_keep_the_defaults() {
        assert_eq!(with(&[]), Ok(LocalCopyConfig::default()));
        let d = LocalCopyConfig::default();
        assert_eq!((d.threads, d.parallel_threshold, d.non_temporal_threshold), (2, 1 << 20, 2048));
        assert!(d.non_temporal);
    }

    #[test]
    fn every_variable_overrides_its_field() {
        let config = with(&[
            (LocalCopyConfig::THREADS_ENV, "8"),
            (LocalCopyConfig::PARALLEL_BYTES_ENV, "4MiB"),
            (LocalCopyConfig::NON_TEMPORAL_BYTES_ENV, " 64ki "),
            (LocalCopyConfig::NON_TEMPORAL_ENV, "off"),
        ]);
        let want = LocalCopyConfig {
            threads: 8,
            parallel_threshold: 4 << 20,
            non_temporal_threshold: 64 << 10,
            non_temporal: false,
        };
        assert_eq!(config, Ok(want));
    }

    #[test]
    fn unreadable_values_are_typed_errors() {
        for (var, value) in [
            (LocalCopyConfig::THREADS_ENV, "0"),
            (LocalCopyConfig::THREADS_ENV, "two"),
            (LocalCopyConfig::PARALLEL_BYTES_ENV, "1.5 parsecs"),
            (LocalCopyConfig::NON_TEMPORAL_BYTES_ENV, "99999999999999999999G"),
            (LocalCopyConfig::NON_TEMPORAL_ENV, "maybe"),
        ] {
            assert_eq!(with(&[(var, value)]), Err(Error::InvalidEnv { var, value: value.into() }));
        }
    }
}
