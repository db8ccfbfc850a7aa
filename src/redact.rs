//! Keeping a database URL's password out of what reaches a person: a driver's error may
//! repeat the URL, or the part of it it could not parse (libpq: `invalid percent-encoded
//! token: "…"`, `… in URI: "postgres://user:password@[bad"`).

use diesel::ConnectionError;

/// What a redacted secret shows instead.
const MASK: &str = "•••";

/// Passwords shorter than this are not searched for inside a message (replacing every `ab`
/// would garble it): a message that holds one is withheld whole.
const SHORTEST_MASKED: usize = 4;

/// The secrets a URL may carry, longest first: the whole URL, its user-info (`user:password`,
/// everything before the last `@` after the scheme) and the password, as written and
/// percent-decoded. For a malformed URL these are guesses that err on hiding more.
fn secrets_of(url: &str) -> Vec<String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let mut secrets = vec![url.to_string()];
    if let Some((userinfo, _)) = rest.rsplit_once('@') {
        secrets.push(userinfo.to_string());
        if let Some((_, password)) = userinfo.split_once(':') {
            secrets.push(password.to_string());
            secrets.push(percent_decoded(password));
        }
    }
    secrets.retain(|s| !s.is_empty());
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    secrets
}

/// `%XX` decoded where it is well formed, the rest kept (lossy for bytes that are not UTF-8).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `message` with every secret of `url` masked.
pub(crate) fn redact(message: &str, url: &str) -> String {
    let mut text = message.to_string();
    for secret in secrets_of(url) {
        if !text.contains(&secret) {
            continue;
        }
        if secret.chars().count() < SHORTEST_MASKED {
            return "the driver's message is withheld: it repeats the URL's password".to_string();
        }
        text = text.replace(&secret, MASK);
    }
    text
}

/// A connection error whose text holds nothing secret of `url`. Every variant is turned
/// into text here, so that not even its `Debug` (a `NulError` holds the URL's bytes) can
/// show the URL.
pub(crate) fn connection_error(source: ConnectionError, url: &str) -> ConnectionError {
    match source {
        ConnectionError::InvalidConnectionUrl(message) => {
            ConnectionError::InvalidConnectionUrl(redact(&message, url))
        }
        ConnectionError::CouldntSetupConfiguration(error) => {
            ConnectionError::CouldntSetupConfiguration(error)
        }
        other => ConnectionError::BadConnection(redact(&other.to_string(), url)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_the_password_is_masked() {
        let url = "postgres://root:hunter2%41secret@[bad";
        let libpq = format!("invalid percent-encoded token: \"hunter2%41secret\" in \"{url}\"");
        let redacted = redact(&libpq, url);
        assert!(!redacted.contains("hunter2"), "{redacted}");
        assert!(redact("password hunter2Asecret", url) == "password •••");
    }

    #[test]
    fn a_short_password_withholds_the_message() {
        let redacted = redact("no access for pw", "postgres://u:pw@host/db");
        assert!(!redacted.contains("pw"), "{redacted}");
    }

    #[test]
    fn messages_without_secrets_are_kept() {
        let message = "connection refused (port 5433)";
        assert_eq!(
            redact(message, "postgres://root:hunter2@localhost:5433/db"),
            message
        );
    }
}
