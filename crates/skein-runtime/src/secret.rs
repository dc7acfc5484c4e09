//! The secret that signs resume tokens, and the random ids the tokens are bound to.

use std::path::Path;

use rand::RngCore;

use crate::{Error, Result};

/// Shortest token-signing secret accepted, in bytes (from the environment or a file).
pub const MIN_SECRET_BYTES: usize = 16;

/// The token-signing secret. Never printed.
#[derive(Clone)]
pub struct Secret(pub Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// The secret from `env_var` when set; otherwise the one kept in `data_dir`
    /// (`token.secret`, made on first use, readable by the owner only).
    pub fn load_or_create(env_var: &str, data_dir: &Path) -> Result<Self> {
        if let Ok(v) = std::env::var(env_var) {
            if v.len() < MIN_SECRET_BYTES {
                return Err(Error::refused(
                    crate::RefusalKind::Config,
                    format!("{env_var} must be at least {MIN_SECRET_BYTES} characters"),
                ));
            }
            return Ok(Self(v.into_bytes()));
        }
        let path = data_dir.join("token.secret");
        match std::fs::read(&path) {
            Ok(v) => {
                let v = v.trim_ascii();
                if v.len() < MIN_SECRET_BYTES {
                    return Err(Error::refused(
                        crate::RefusalKind::Config,
                        format!(
                            "the token secret in {} holds {} bytes; at least {MIN_SECRET_BYTES} \
                         are needed (remove the file to have a new one made, which makes \
                         the tokens handed out so far invalid, or set {env_var})",
                            path.display(),
                            v.len()
                        ),
                    ));
                }
                return Ok(Self(v.to_vec()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::unavailable(
                    format!("cannot read the token secret {}", path.display()),
                    e,
                ))
            }
        }
        std::fs::create_dir_all(data_dir)
            .map_err(|e| Error::unavailable(format!("cannot create {}", data_dir.display()), e))?;
        let mut b = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut b);
        let hexed = hex::encode(b);
        write_private(&path, hexed.as_bytes())?;
        Ok(Self(hexed.into_bytes()))
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts
        .open(path)
        .map_err(|e| Error::unavailable(format!("cannot create {}", path.display()), e))?;
    f.write_all(data)
        .map_err(|e| Error::unavailable(format!("cannot write {}", path.display()), e))
}

/// A fresh token id (the nonce recorded in the pausing event).
pub fn new_token_id() -> String {
    let mut b = [0u8; 12];
    rand::thread_rng().fill_bytes(&mut b);
    hex::encode(b)
}
