//! `STREAMBP_BF16_KERNEL` picks the bf16 products' kernel among those the CPU can run, and a value
//! it cannot honour leaves the CPU's own choice: the test runs itself again in child processes, one
//! per value (the choice is read once per process), and each child checks what it got.

use streambp_kernels::choices::{Kernel, KERNEL_ENV};

/// The value a child was given, and the kernel it must then run (set only in children).
const EXPECT_ENV: &str = "STREAMBP_BF16_KERNEL_EXPECT";
const TEST_NAME: &str = "the_environment_picks_a_kernel_the_cpu_can_run";

#[test]
fn the_environment_picks_a_kernel_the_cpu_can_run() {
    if let Ok(expected) = std::env::var(EXPECT_ENV) {
        assert_eq!(Kernel::detect().name(), expected, "{KERNEL_ENV}");
        return;
    }
    // The kernel this CPU takes by itself, which only a process without the variable shows.
    if let Ok(set) = std::env::var(KERNEL_ENV) {
        println!("not checked: {KERNEL_ENV}={set} is set for the whole test run");
        return;
    }
    let own = Kernel::detect();
    let available = Kernel::available();
    // AMX's kernel on its software model where the CPU has no AMX, on its tiles where it has.
    let mut cases = vec![
        ("widened", "widened"),
        ("no-such-kernel", own.name()),
        ("amx-emulated", "amx"),
    ];
    // Each kernel that needs instructions of its own: itself where the CPU has them.
    for kernel in [Kernel::Bf16Dot, Kernel::Amx] {
        let name = kernel.name();
        cases.push(match available.contains(&kernel) {
            true => (name, name),
            false => (name, own.name()),
        });
    }
    for (asked, expected) in cases {
        let status = streambp_testkit::command(std::env::current_exe().unwrap())
            .args([TEST_NAME, "--exact", "--test-threads", "1"])
            .env(KERNEL_ENV, asked)
            .env(EXPECT_ENV, expected)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "{KERNEL_ENV}={asked}: expected {expected}"
        );
    }
    println!(
        "kernels on this CPU: {:?}, its own choice {}",
        available.iter().map(|k| k.name()).collect::<Vec<_>>(),
        own.name()
    );
}
