//! A park's completion token: `<job id>.<secret>`, the secret 32 bytes from the operating
//! system's random source, written as 64 hex digits. Only the secret's SHA-256 is stored, and
//! the comparison with it takes the same time whatever the bytes. The token is in no `Debug`
//! output, no `Display`, no error and no log: [`ParkToken::expose_secret`] is the one way to
//! read it, for the party it is handed to.

use std::fmt;

use rand::TryRngCore;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The secret's length in bytes (256 bits).
const SECRET_BYTES: usize = 32;

/// The token that completes, fails or resumes one parked job, once
/// ([`complete_parked`](crate::jobs::complete_parked)). Hand it to the outside party (a
/// webhook's URL, an approval mail); tenure keeps only its hash.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::ParkToken;
/// let token: ParkToken = "7.00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff".parse()?;
/// assert_eq!(token.job_id(), 7);
/// assert!(!format!("{token:?}").contains("0011")); // the secret is never printed
/// assert!("7.guess".parse::<ParkToken>().is_err());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ParkToken {
    job_id: i64,
    secret: [u8; SECRET_BYTES],
}

impl ParkToken {
    /// A new token for `job_id`, from the operating system's random source.
    pub(crate) fn generate(job_id: i64) -> Result<ParkToken> {
        let mut secret = [0u8; SECRET_BYTES];
        rand::rngs::OsRng.try_fill_bytes(&mut secret).map_err(|e| {
            Error::invalid("park token", format!("the OS random source failed: {e}"))
        })?;
        Ok(ParkToken { job_id, secret })
    }

    /// The job it is about.
    pub fn job_id(&self) -> i64 {
        self.job_id
    }

    /// The token as text, to hand to the party that will answer the park. Keep it out of
    /// logs: whoever reads it can finish the job.
    pub fn expose_secret(&self) -> String {
        let mut text = format!("{}.", self.job_id);
        for byte in self.secret {
            text.push_str(&format!("{byte:02x}"));
        }
        text
    }

    /// The hash stored in `tenure_parked.token_hash`.
    pub(crate) fn hash(&self) -> Vec<u8> {
        Sha256::digest(self.secret).to_vec()
    }

    /// Whether `stored` is this token's hash, in a time that does not depend on where they
    /// differ.
    pub(crate) fn matches(&self, stored: &[u8]) -> bool {
        let mine = self.hash();
        if mine.len() != stored.len() {
            return false;
        }
        let diff = mine
            .iter()
            .zip(stored)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

impl std::str::FromStr for ParkToken {
    type Err = Error;

    /// Reads `<job id>.<64 hex digits>` (surrounding whitespace ignored, so a token read
    /// from a file or stdin may end in a newline). Anything else is
    /// [`Error::ParkTokenRefused`] with [`ParkRefusal::Invalid`](crate::jobs::ParkRefusal),
    /// as a wrong token is: the error never repeats the text.
    fn from_str(text: &str) -> Result<ParkToken> {
        let refused = || Error::ParkTokenRefused(super::ParkRefusal::Invalid);
        let (id, hex) = text.trim().split_once('.').ok_or_else(refused)?;
        let job_id: i64 = id.parse().map_err(|_| refused())?;
        if job_id <= 0 || hex.len() != SECRET_BYTES * 2 || !hex.is_ascii() {
            return Err(refused());
        }
        let mut secret = [0u8; SECRET_BYTES];
        for (i, byte) in secret.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).map_err(|_| refused())?;
        }
        Ok(ParkToken { job_id, secret })
    }
}

impl fmt::Debug for ParkToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ParkToken(job {}, secret hidden)", self.job_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_reads_back_and_matches_only_its_own_hash() {
        let token = ParkToken::generate(42).unwrap();
        let text = token.expose_secret();
        let back: ParkToken = format!("{text}\n").parse().unwrap();
        assert_eq!(back.job_id(), 42);
        assert!(back.matches(&token.hash()));
        let other = ParkToken::generate(42).unwrap();
        assert!(!other.matches(&token.hash()));
        assert!(!format!("{token:?}").contains(&text[3..]));
    }

    #[test]
    fn malformed_tokens_are_refused_without_the_text() {
        for bad in ["", "1", "x.00", "-1.00", "1.zz", "0.00", "1.ü"] {
            let error = bad.parse::<ParkToken>().unwrap_err();
            assert!(matches!(error, Error::ParkTokenRefused(_)), "{bad:?}");
        }
    }
}
