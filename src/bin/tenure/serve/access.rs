//! Who may use the dashboard: the credentials it asks for (from the environment or a file,
//! never the command line, where `ps` shows them), the Host names it answers unguarded, and
//! the CSRF token every action carries.

use std::net::SocketAddr;
use std::path::Path;

use base64::Engine;

use crate::Failure;

/// The variable holding an access token (a browser gives it as the basic-auth password).
pub const TOKEN_VAR: &str = "TENURE_SERVE_TOKEN";
/// The variable holding `user:password` for basic auth.
pub const BASIC_VAR: &str = "TENURE_SERVE_BASIC_AUTH";
/// The shortest token or password accepted: a guessable secret guards nothing.
const MIN_SECRET: usize = 16;

/// What a request must show.
enum Credentials {
    /// `Authorization: Bearer T`, or basic auth with password T (any user).
    Token(String),
    /// Basic auth with this user and password.
    Basic { user: String, password: String },
}

/// The dashboard's access rules, fixed at start.
pub struct Access {
    credentials: Option<Credentials>,
    csrf: String,
}

/// Where the credentials come from: the flags name files, else the variables are read.
pub struct Sources<'a> {
    pub token_file: Option<&'a Path>,
    pub basic_auth_file: Option<&'a Path>,
}

impl Access {
    /// Reads the credentials and checks them against the listening address: anything but
    /// loopback needs credentials.
    pub fn configure(sources: Sources<'_>, listen: SocketAddr) -> Result<Access, Failure> {
        let from_file = |path: &Path, what: &str| {
            std::fs::read_to_string(path)
                .map(|text| text.trim_end_matches(['\n', '\r']).to_string())
                .map_err(|e| {
                    Failure::new(
                        2,
                        format!("cannot read the {what} file {}: {e}", path.display()),
                    )
                })
        };
        let token = match sources.token_file {
            Some(path) => Some(from_file(path, "token")?),
            None => std::env::var(TOKEN_VAR).ok().filter(|t| !t.is_empty()),
        };
        let basic = match sources.basic_auth_file {
            Some(path) => Some(from_file(path, "basic-auth")?),
            None => std::env::var(BASIC_VAR).ok().filter(|t| !t.is_empty()),
        };
        let credentials = match (token, basic) {
            (Some(_), Some(_)) => {
                return Err(Failure::new(
                    2,
                    "both a token and basic-auth credentials were given: give one",
                ));
            }
            (Some(token), None) => {
                check_secret("the access token", &token)?;
                Some(Credentials::Token(token))
            }
            (None, Some(pair)) => {
                let (user, password) = pair
                    .split_once(':')
                    .filter(|(user, _)| !user.is_empty())
                    .ok_or_else(|| {
                        Failure::new(2, "the basic-auth credentials are not user:password")
                    })?;
                check_secret("the basic-auth password", password)?;
                Some(Credentials::Basic {
                    user: user.to_string(),
                    password: password.to_string(),
                })
            }
            (None, None) => None,
        };
        if credentials.is_none() && !listen.ip().is_loopback() {
            return Err(Failure::new(
                2,
                format!(
                    "refusing to listen on {listen} without credentials: anyone who reaches it \
                     could retry, cancel and release. Set {TOKEN_VAR} or {BASIC_VAR} \
                     (user:password), or give --token-file or --basic-auth-file"
                ),
            ));
        }
        let csrf: [u8; 32] = rand::random();
        Ok(Access {
            credentials,
            csrf: csrf.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// Whether credentials are asked for.
    pub fn guarded(&self) -> bool {
        self.credentials.is_some()
    }

    /// The token every action's form carries.
    pub fn csrf(&self) -> &str {
        &self.csrf
    }

    /// Whether an action's `csrf` field is this process's token.
    pub fn csrf_matches(&self, given: &str) -> bool {
        same(given.as_bytes(), self.csrf.as_bytes())
    }

    /// Whether a request with this `Authorization` header (if any) and `Host` may proceed.
    /// Without credentials, only loopback Host names are answered: a page that a DNS
    /// rebinding attack points at 127.0.0.1 arrives with its own Host name.
    pub fn admits(&self, authorization: Option<&str>, host: Option<&str>) -> Verdict {
        let Some(credentials) = &self.credentials else {
            return if host.is_some_and(is_loopback_host) {
                Verdict::Admitted
            } else {
                Verdict::WrongHost
            };
        };
        let Some(header) = authorization else {
            return Verdict::Unauthorized;
        };
        let admitted = match (credentials, header.split_once(' ')) {
            (Credentials::Token(token), Some((scheme, given)))
                if scheme.eq_ignore_ascii_case("bearer") =>
            {
                same(given.trim().as_bytes(), token.as_bytes())
            }
            (credentials, Some((scheme, encoded))) if scheme.eq_ignore_ascii_case("basic") => {
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(encoded.trim())
                    .unwrap_or_default();
                let decoded = String::from_utf8(decoded).unwrap_or_default();
                match (credentials, decoded.split_once(':')) {
                    (Credentials::Token(token), Some((_, password))) => {
                        same(password.as_bytes(), token.as_bytes())
                    }
                    (Credentials::Basic { user, password }, Some((u, p))) => {
                        // Both compared, so that the time taken does not tell which failed.
                        let user_ok = same(u.as_bytes(), user.as_bytes());
                        same(p.as_bytes(), password.as_bytes()) & user_ok
                    }
                    _ => false,
                }
            }
            _ => false,
        };
        if admitted {
            Verdict::Admitted
        } else {
            Verdict::Unauthorized
        }
    }
}

/// What [`Access::admits`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Admitted,
    Unauthorized,
    WrongHost,
}

fn check_secret(what: &str, secret: &str) -> Result<(), Failure> {
    if secret.chars().count() < MIN_SECRET {
        return Err(Failure::new(
            2,
            format!("{what} is shorter than {MIN_SECRET} characters"),
        ));
    }
    Ok(())
}

/// Compares without stopping at the first difference (the length may show; the content
/// does not).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `localhost`, `127.x.x.x` or `[::1]`, with or without a port (digits), and nothing else.
fn is_loopback_host(host: &str) -> bool {
    let port_ok = |port: &str| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let Some((inside, after)) = rest.split_once(']') else {
            return false;
        };
        match after.strip_prefix(':') {
            Some(port) => (inside, Some(port)),
            None if after.is_empty() => (inside, None),
            None => return false,
        }
    } else {
        match host.split_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        }
    };
    if port.is_some_and(|port| !port_ok(port)) {
        return false;
    }
    if host.starts_with('[') {
        return name
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|ip| ip.is_loopback());
    }
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for host in [
            "localhost:8080",
            "127.0.0.1",
            "127.0.0.1:80",
            "[::1]:9",
            "LOCALHOST",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example:8080",
            "10.0.0.1",
            "localhost.evil.example",
            "",
            "[::2]:1",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn compares_whole_secrets() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
    }
}
