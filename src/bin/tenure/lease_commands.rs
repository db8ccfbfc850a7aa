//! `tenure leases`: list and release leases, and run a command while holding one.

use clap::Subcommand;
use serde_json::json;
use tenure::Pool;

use crate::output::{Out, age, table};
use crate::{Failure, Outcome, lease_run};

#[derive(Subcommand)]
pub enum LeasesCommand {
    /// Every lease's holders: slot, holder, fence, expiry, value.
    List,
    /// Show every holder of the lease NAME (a lease of N holders has N slots), and how many
    /// wait in line.
    Show { name: String },
    /// Print who holds the lease NAME each time that changes (a leader election's leader),
    /// until interrupted or COUNT changes were printed.
    Watch {
        name: String,
        /// Stop after this many lines.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Release a lease whoever holds it. Its holder is not told: use only for a holder you
    /// know is gone.
    Release {
        name: String,
        /// Confirm that the holder is gone.
        #[arg(long)]
        force: bool,
    },
    /// Run a command while holding the lease NAME, so runs of it never overlap (cron jobs):
    /// `tenure lease run NAME [--ttl 30s] [--wait 10m | --no-wait] -- COMMAND [ARGS...]`.
    #[command(after_help = lease_run::ABOUT)]
    Run(lease_run::RunArgs),
}

pub fn run(pool: &Pool, command: LeasesCommand, out: &Out) -> Outcome {
    let mut conn = pool.get()?;
    match command {
        LeasesCommand::List => {
            let leases = tenure::lease::list(&mut conn)?;
            print_holders(out, &leases)
        }
        LeasesCommand::Show { name } => {
            let holders = tenure::lease::holders(&mut conn, &name)?;
            if holders.is_empty() {
                return Err(Failure::new(1, format!("no lease {name:?} was ever taken")));
            }
            print_holders(out, &holders)
        }
        LeasesCommand::Watch { name, count } => watch(&mut conn, &name, count, out),
        LeasesCommand::Release { name, force } => {
            if !force {
                return Err(Failure::new(
                    2,
                    "releasing a lease someone may hold needs --force (its holder is not told)",
                ));
            }
            let released = tenure::lease::force_release(&mut conn, &name)?;
            if !released {
                return Err(Failure::new(1, format!("no lease {name:?} is held")));
            }
            out.print(json!({"released": name}), || format!("released {name:?}"))
        }
        // Dispatched in `main`, before a pool of this size is opened.
        LeasesCommand::Run(_) => Err(Failure::new(1, "`lease run` reached the wrong place")),
    }
}

fn print_holders(out: &Out, leases: &[tenure::lease::LeaseInfo]) -> Outcome {
    out.print(
        json!(
            leases
                .iter()
                .map(
                    |l| json!({"name": l.name, "slot": l.slot, "holder": l.holder,
            "fence": l.fence, "held": l.held, "acquired_at": l.acquired_at,
            "expires_at": l.expires_at, "value": l.value})
                )
                .collect::<Vec<_>>()
        ),
        || {
            table(
                &[
                    "name",
                    "slot",
                    "holder",
                    "fence",
                    "held",
                    "expires in",
                    "value",
                ],
                leases.iter().map(|l| {
                    vec![
                        l.name.clone(),
                        l.slot.to_string(),
                        l.holder.clone(),
                        l.fence.to_string(),
                        if l.held { "yes".into() } else { "no".into() },
                        if l.held {
                            age(l.expires_at - l.now)
                        } else {
                            String::new()
                        },
                        l.value.clone().unwrap_or_default(),
                    ]
                }),
            )
        },
    )
}

/// How often `lease watch` reads the lease.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Prints the lease's holders (label, fence, value) whenever they change.
fn watch(conn: &mut tenure::AnyConnection, name: &str, count: Option<u64>, out: &Out) -> Outcome {
    let mut last: Option<Vec<(String, i64, Option<String>)>> = None;
    let mut printed = 0;
    while count.is_none_or(|count| printed < count) {
        let holders: Vec<_> = tenure::lease::holders(conn, name)?
            .into_iter()
            .filter(|h| h.held)
            .map(|h| (h.holder, h.fence, h.value))
            .collect();
        if last.as_ref() != Some(&holders) {
            out.print(
                json!({"name": name, "holders": holders.iter().map(|(holder, fence, value)|
                    json!({"holder": holder, "fence": fence, "value": value})).collect::<Vec<_>>()}),
                || match holders.is_empty() {
                    true => format!("{name}: nobody"),
                    false => holders
                        .iter()
                        .map(|(holder, fence, value)| match value {
                            Some(value) => format!("{name}: {holder} (fence {fence}, value {value})"),
                            None => format!("{name}: {holder} (fence {fence})"),
                        })
                        .collect::<Vec<_>>()
                        .join("\n"),
                },
            )?;
            printed += 1;
            last = Some(holders);
        }
        std::thread::sleep(WATCH_EVERY);
    }
    Ok(())
}
