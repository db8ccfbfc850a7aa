//! Keeping a database URL's password out of what reaches a person: a driver's error may
//! repeat the URL, or the part of it it could not parse (libpq: `invalid percent-encoded
//! token: "…"`, `… in URI: "postgres://user:password@[bad"`).

use diesel::ConnectionError;

/// What a redacted secret shows instead.
const MASK: &str = "•••";

/// Passwords (and pieces of them) shorter than this are not masked inside a message
/// (replacing every `ab` would garble it): a message that holds one as a word of its own is
/// withheld whole.
const SHORTEST_MASKED: usize = 4;

/// The secrets a URL may carry, longest first: the whole URL, its user-info (`user:password`,
/// everything before the last `@` after the scheme) and the password, as written and
/// percent-decoded. For a malformed URL these are guesses that err on hiding more.
///
/// A password is also taken from the query (libpq's `password=` and `sslpassword=`, their
/// names percent-decoded as libpq decodes them), and each piece of a password between URL
/// delimiters is a secret too: drivers split a URL differently (libpq ends the user-info at
/// the first `@` or `/`, so `u:hunter2/secret@h` gives the port "hunter2", and
/// `u:hunter2@secret@h` the host "secret@h"), and may echo one piece alone.
fn secrets_of(url: &str) -> Vec<String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let mut secrets = vec![url.to_string()];
    let mut passwords = Vec::new();
    if let Some((userinfo, _)) = rest.rsplit_once('@') {
        secrets.push(userinfo.to_string());
        if let Some((_, password)) = userinfo.split_once(':') {
            passwords.push(password);
        }
    }
    if let Some((_, query)) = rest.split_once('?') {
        for (name, value) in query.split('&').filter_map(|pair| pair.split_once('=')) {
            if matches!(percent_decoded(name).as_str(), "password" | "sslpassword") {
                passwords.push(value);
            }
        }
    }
    for password in passwords {
        for piece in std::iter::once(password).chain(password.split(['@', '/', '?', '#', ':'])) {
            secrets.push(piece.to_string());
            secrets.push(percent_decoded(piece));
        }
    }
    secrets.retain(|s| !s.is_empty());
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    secrets
}

/// Whether `secret` occurs in `text` as a word of its own: not inside a longer run of
/// letters and digits (a driver echoes a URL's pieces between its delimiters or quotes; a
/// short password found only inside words, like `nn` in "Connection refused", is not echoed).
fn stands_alone(text: &str, secret: &str) -> bool {
    let word = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    (0..text.len())
        .filter(|&at| text.is_char_boundary(at) && text[at..].starts_with(secret))
        .any(|at| {
            !word(text[..at].chars().next_back()) && !word(text[at + secret.len()..].chars().next())
        })
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
            if stands_alone(&text, &secret) {
                return "the driver's message is withheld: it repeats the URL's password"
                    .to_string();
            }
            continue;
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
    fn a_short_password_inside_words_keeps_the_message() {
        let message = "Connection refused: is the server running on that host?";
        assert_eq!(redact(message, "postgres://u:nn@host/db"), message);
    }

    #[test]
    fn pieces_and_query_passwords_are_masked() {
        let port = "invalid integer value \"hunter2\" for connection option \"port\"";
        assert!(!redact(port, "postgres://u:hunter2/secret@h/db").contains("hunter2"));
        let host = "could not translate host name \"secret@h\" to address";
        assert!(!redact(host, "postgres://u:hunter2@secret@h/db").contains("secret"));
        let token = "invalid percent-encoded token: \"hunter2%zz\"";
        for url in [
            "postgres://u@h/db?password=hunter2%zz",
            "postgres://u@h/db?sslmode=disable&sslpassword=hunter2%zz",
            "postgres://u@h/db?pass%77ord=hunter2%zz",
        ] {
            assert!(!redact(token, url).contains("hunter2"), "{url}");
        }
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
